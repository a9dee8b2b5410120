"""Context-free grammars for structured outputs: vLLM's ``structured_outputs.grammar`` and
``guided_grammar``, Lark text or llama.cpp's GBNF, through llguidance (``pip install
'laguna-dflash[structured]'``; vLLM's ``guidance`` backend is the same library).

llguidance parses the grammar with an Earley parser over the tokenizer's own vocabulary
(``LLTokenizer``, built from its ``tokenizer.json``) and gives, for the tokens taken so far,
the bit set of the next allowed tokens (32 to an int32, as :func:`pack_token_bits`). Its
matcher is a state that takes tokens and gives them back (``rollback``), which is what
:class:`ConstraintMatcher` walks drafts with; so DFlash stays lossless under a grammar as under
a regex. Unlike the regex automaton nothing is cached per state: every row's bit set is computed
(~0.1-1 ms each, host side). Where the grammar forces the next bytes (no choice left until a
branch), llguidance allows only the first token of their canonical tokenization, not every
token that spells a prefix of them (``))`` then ``)))`` for five forced ``)``), as vLLM's
``guidance`` backend does.

The grammar's EOS is the engine's to allow, as for the regex backend: llguidance's EOS bit is
cleared from every bit set and the request's stop tokens are allowed where the grammar accepts.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from .structured_outputs import ConstraintMatcher, pack_token_bits

#: the PyPI package and version this is tested against (pyproject's ``structured`` extra)
CFG_BACKEND_REQUIREMENT = "llguidance==1.9.1"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError(f"structured_outputs.grammar needs {CFG_BACKEND_REQUIREMENT}: pip install "
                          "'laguna-dflash[structured]'") from None
    return llguidance


def tokenizer_json(tokenizer: Any) -> str:
    """The ``tokenizer.json`` text of a fast (Rust ``tokenizers``) tokenizer, padding and
    truncation off: what llguidance builds its vocabulary from."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured_outputs.grammar needs a fast tokenizer (a tokenizer.json), and "
                         f"this model's is a {type(tokenizer).__name__}; express the output as a "
                         "regex or JSON schema instead")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(text: str, vocab_size: int, eos_token: int | None) -> Any:
    """llguidance's tokenizer of ``tokenizer.json`` text over ``vocab_size`` ids, or over the
    tokenizer's own ids where it has more (a model may leave added tokens out of its vocabulary;
    their bits are cleared, CfgMatcher). ~ms per 1k tokens: built once a process, for the
    compiler and for unpickled grammars alike."""
    llg = _llguidance()
    own = llg.LLTokenizer(text, eos_token=eos_token)
    return own if own.vocab_size >= vocab_size else llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token)


class CfgGrammar:
    """A compiled grammar (Lark or GBNF ``text``) over a model's vocabulary of ``vocab_size``
    ids, shared by the requests with the same grammar and picklable (tensor-parallel ranks
    rebuild llguidance's tokenizer from the ``tokenizer.json`` text). Each request's
    :meth:`matcher` copies a fresh matcher built once here."""

    def __init__(self, text: str, definition: str, tokenizer_text: str, vocab_size: int,
                 eos_token: int | None) -> None:
        self.text = text
        self.definition = definition  # llguidance's grammar (JSON text)
        self.vocab_size = vocab_size
        self._tokenizer_text = tokenizer_text
        self._eos_token = eos_token
        tokenizer = _ll_tokenizer(tokenizer_text, vocab_size, eos_token)
        self.eos_token = tokenizer.eos_token  # whose bit llguidance sets where the grammar accepts
        self._fresh = _llguidance().LLMatcher(tokenizer, definition, log_level=0)
        if self._fresh.is_error():
            raise ValueError(f"StructuredOutputsParams.grammar cannot be used: {self._fresh.get_error()}")

    @classmethod
    def compile(cls, text: str, tokenizer_text: str, vocab_size: int, eos_token: int | None) -> CfgGrammar:
        """``text``, a Lark or GBNF grammar; a ValueError naming the field where it is not one."""
        llg = _llguidance()
        try:
            definition = llg.grammar_from("grammar", text)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.grammar is not a valid Lark or GBNF grammar: {e}") from None
        error = llg.LLMatcher.validate_grammar(definition, _ll_tokenizer(tokenizer_text, vocab_size, eos_token))
        if error:
            raise ValueError(f"StructuredOutputsParams.grammar is not a valid Lark or GBNF grammar: "
                             f"{error.strip()[:400]}")
        return cls(text, definition, tokenizer_text, vocab_size, eos_token)

    def __getstate__(self) -> dict:
        return {"text": self.text, "definition": self.definition, "tokenizer_text": self._tokenizer_text,
                "vocab_size": self.vocab_size, "eos_token": self._eos_token}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def matcher(self, stop_token_ids: tuple[int, ...]) -> CfgMatcher:
        """A request's matcher; ``stop_token_ids`` are allowed where the grammar accepts."""
        return CfgMatcher(self, stop_token_ids)


class CfgMatcher(ConstraintMatcher):
    """A :class:`CfgGrammar`'s matcher: llguidance's matcher takes tokens (``consume_token``,
    after ``validate_tokens`` says it may: a refused token must not put it in its error state)
    and gives them back (``rollback``)."""

    def __init__(self, grammar: CfgGrammar, stop_token_ids: tuple[int, ...]) -> None:
        super().__init__(grammar.vocab_size, stop_token_ids)
        self.grammar = grammar
        self._matcher = grammar._fresh.deep_copy()
        self._num_words = self._stop_bits.numel()
        # the bits llguidance's masks keep: the vocabulary's ids, its EOS aside
        keep = torch.ones(grammar.vocab_size, dtype=torch.bool)
        if 0 <= grammar.eos_token < grammar.vocab_size:
            keep[grammar.eos_token] = False
        self._keep = pack_token_bits(keep.nonzero().flatten(), grammar.vocab_size)

    def _advance(self, token: int) -> bool:
        if token == self.grammar.eos_token or self._matcher.validate_tokens([token]) != 1:
            return False
        taken = self._matcher.consume_token(token)
        assert taken, self._matcher.get_error()
        return True

    def _rewind(self, num_tokens: int) -> None:
        if num_tokens:
            assert self._matcher.rollback(num_tokens), self._matcher.get_error()

    def _allowed_bits(self) -> torch.Tensor:
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        return words[: self._num_words] & self._keep

    def _is_final(self) -> bool:
        return self._matcher.is_accepting()

    def _is_exhausted(self) -> bool:
        return self._matcher.is_stopped()
