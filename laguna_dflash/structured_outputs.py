"""vLLM's structured outputs: JSON schema, regex, choice and any-JSON-object constraints, through
outlines-core (``pip install 'laguna-dflash[structured]'``); context-free grammars through
llguidance (structured_cfg.py), under the same :class:`ConstraintMatcher`.

A constraint compiles (:class:`StructuredOutputCompiler`, once per tokenizer) to a regular
expression and then to a token-level automaton over the tokenizer's byte strings
(``outlines_core.Index``): from state ``s`` token ``t`` is allowed iff a transition ``s -t-> s'``
exists; in a final state the request's stop tokens are allowed too. The engine keeps one
:class:`ConstraintMatcher` per request; the logits row that scores output position ``n`` is masked
to the tokens allowed in the state reached by the ``n`` outputs (engine/penalties.py), the
row after verify drafts ``d_1 .. d_j`` in the state reached by the outputs and then those drafts
(as target-only decoding would be, if the drafts are accepted; a draft the automaton refuses is
never accepted, as its logit is -inf, so the rows after it are never used). Masks are built on
the host from the state (cached per state, packed 32 tokens an int32) and unpacked on the device.

Not here (as the 400s / ValueErrors say): xgrammar's structural tags. JSON schemas nest at most ``max_recursion_depth``
levels where they recurse (outlines-core's regex translation); ``json_object`` admits objects
whose values nest objects and arrays one level (``MAX_JSON_OBJECT_DEPTH``: deeper ones make the
automaton too large to compile quickly).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: the PyPI package and version this is tested against (pyproject's ``structured`` extra)
BACKEND_REQUIREMENT = "outlines-core==0.2.14"
#: JSON nesting depth a recursive schema (or ``json_object``) is unrolled to
MAX_JSON_DEPTH = 3


def _backend() -> Any:
    try:
        import outlines_core
    except ImportError:
        raise ImportError(f"structured outputs need {BACKEND_REQUIREMENT}: pip install "
                          "'laguna-dflash[structured]'") from None
    return outlines_core


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, as a dict or
    its text), ``regex``, ``choice`` (the output is one of these strings), ``json_object`` (any
    JSON object) or ``grammar`` (a context-free grammar, Lark or GBNF text: structured_cfg.py).
    ``whitespace_pattern`` (a regex) is the whitespace allowed between JSON tokens (default: at
    most one space); ``disable_any_whitespace`` allows none. ``structural_tag`` is vLLM's too
    (xgrammar's tags): a ValueError."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.structural_tag is not None:
            raise ValueError("StructuredOutputsParams.structural_tag (xgrammar's structural tags) is "
                             "not supported; express the output as a grammar (Lark or GBNF), a "
                             "JSON schema (json) or a regular expression (regex)")
        given = [name for name in ("json", "regex", "choice", "json_object", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, regex, choice, "
                             f"json_object and grammar, got {given or 'none'}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("StructuredOutputsParams.grammar must be a Lark or GBNF grammar (a "
                             f"non-empty string), got {self.grammar!r:.80}")
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r:.80}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"StructuredOutputsParams.regex must be a string, got {self.regex!r:.80}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("StructuredOutputsParams.json must be a JSON schema (an object), "
                                 f"got {self.json!r:.80}")

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        """``value`` as params: a dict of the fields (vLLM's request field) is converted."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its "
                             f"fields, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__) - _IGNORED_FIELDS)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; it takes "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**{k: v for k, v in value.items() if k not in _IGNORED_FIELDS})

    def to_regex(self) -> str:
        """The constraint as one regular expression (outlines-core's syntax, Rust's ``regex``);
        not for a ``grammar``."""
        assert self.grammar is None, "a grammar is no regular expression"
        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return "(" + "|".join(re.escape(c) for c in self.choice) + ")"
        whitespace = "" if self.disable_any_whitespace else self.whitespace_pattern
        if self.json_object:
            return json_object_regex(MAX_JSON_OBJECT_DEPTH, DEFAULT_WHITESPACE if whitespace is None else whitespace)
        text = self.json if isinstance(self.json, str) else json.dumps(self.json)
        return _backend().json_schema.build_regex_from_schema(text, whitespace, MAX_JSON_DEPTH)


#: whitespace allowed between JSON tokens unless a request says otherwise (outlines-core's)
DEFAULT_WHITESPACE = "[ ]?"
#: ``json_object``'s nesting: objects and arrays inside the object hold no deeper ones. Each
#: level multiplies the automaton (and the compile, which walks the vocabulary from every
#: state): 105, 449, 1825 and 7330 states at depths 1-4, compiled over a 4096-token vocabulary
#: in 0.01, 0.13, 5.5 and 228 s (the demo tokenizer, one CPU core)
MAX_JSON_OBJECT_DEPTH = 2
_JSON_STRING = r'"([^"\\\x00-\x1F]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
_JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"


def json_object_regex(depth: int, whitespace: str) -> str:
    """Any JSON object whose values nest objects and arrays ``depth - 1`` levels deep, with
    ``whitespace`` (a regex) around its punctuation."""
    ws, scalar = f"({whitespace})", f"({_JSON_STRING}|{_JSON_NUMBER}|true|false|null)"
    value, obj = scalar, ""
    for _ in range(depth):
        member = f"{_JSON_STRING}{ws}:{ws}{value}"
        obj = rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"
        array = rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"
        value = f"({_JSON_STRING}|{_JSON_NUMBER}|true|false|null|{obj}|{array})"
    return obj


#: the largest count a counted repetition ``{m}``, ``{m,}``, ``{m,n}`` may have
MAX_REPETITION = 4096
_COUNTED = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")

#: vLLM fields that choose among its backends' behaviours and change nothing here
_IGNORED_FIELDS = {"disable_fallback", "disable_additional_properties", "backend"}


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's characters -> bytes: the printable bytes ('!'..'~', '¡'..'¬', '®'..'ÿ')
    stand for themselves, the other 68 for chr(256 + i) in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in kept}
    for i, b in enumerate(b for b in range(256) if b not in set(kept)):
        table[chr(256 + i)] = b
    return table


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The decoder types of a fast tokenizer (a Sequence's members too), e.g. {"ByteLevel"}."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    members = decoder.get("decoders") or [decoder]
    return {d.get("type") for d in members if isinstance(d, dict)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_byte_strings(tokenizer: Any, vocab_size: int) -> dict[bytes, list[int]]:
    """``{bytes: [token ids]}``: what each ordinary token id below ``vocab_size`` writes into
    the output, as bytes (a byte-level BPE token may hold part of a UTF-8 character). Special
    tokens are left out (the stop tokens are allowed separately)."""
    kinds = _decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    decoder = _byte_decoder() if byte_level else {}
    special = set(getattr(tokenizer, "all_special_ids", ()))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(token_id)
    out: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id >= vocab_size or token_id in special:
            continue
        if byte_level:
            if any(c not in decoder for c in token):
                continue  # an added non-special token outside the byte alphabet: its text
            data = bytes(decoder[c] for c in token)
        elif (m := _BYTE_TOKEN.fullmatch(token)) is not None:  # SentencePiece byte fallback
            data = bytes([int(m.group(1), 16)])
        else:
            data = token.replace("▁", " ").encode("utf-8")  # Metaspace: "▁" is a space
        if data:
            out.setdefault(data, []).append(token_id)
    return out


#: The character every compiled regex is followed by (``(R)END``), spelled by a token past the
#: model's vocabulary (``end_token``): a state completes ``R`` iff that token is allowed there.
#: outlines-core 0.2.10-0.2.14 drop a one-byte token's transition out of a FINAL state into a
#: non-final one (``(ab)+`` after "ab" refused "a"; a JSON number after "12" refused "."), so
#: no state of ``R`` itself may be final. U+10FFFF is a noncharacter no text should hold.
END_OF_MATCH = "\U0010FFFF"


class Grammar:
    """A compiled constraint: outlines-core's token automaton over a model's vocabulary
    (``vocab_size`` ids), shared by every request with the same constraint (and picklable, for
    tensor-parallel ranks). ``allowed_bits(state)``: the state's allowed tokens packed 32 to an
    int32 (``[ceil(V / 32)]``; bit ``t % 32`` of word ``t // 32``), cached per state.
    ``end_token``: the id spelling :data:`END_OF_MATCH` (:meth:`from_regex`, the one way to
    make one), whose transition marks the states that complete the regex."""

    def __init__(self, index: Any, vocab_size: int, regex: str, end_token: int) -> None:
        self.index = index
        self.vocab_size = vocab_size
        self.regex = regex
        self.end_token = end_token
        self._bits: dict[int, torch.Tensor] = {}  # one dict store: safe across threads

    @classmethod
    def from_regex(cls, regex: str, vocabulary: Any, vocab_size: int) -> Grammar:
        """``regex`` over ``vocabulary`` (:func:`terminated_vocabulary`: token ``vocab_size``
        spells :data:`END_OF_MATCH`). ValueError where outlines-core cannot compile it."""
        try:
            index = _backend().Index(f"({regex}){END_OF_MATCH}", vocabulary)
        except ValueError as e:
            raise ValueError(f"the constraint's regular expression {regex!r:.120} cannot be "
                             f"compiled over this tokenizer's vocabulary: {e}") from None
        return cls(index, vocab_size, regex, end_token=vocab_size)

    def __getstate__(self) -> dict:
        return {"index": self.index, "vocab_size": self.vocab_size, "regex": self.regex,
                "end_token": self.end_token}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["index"], state["vocab_size"], state["regex"], state["end_token"])

    @property
    def initial_state(self) -> int:
        return self.index.get_initial_state()

    def next_state(self, state: int, token: int) -> int | None:
        """The state after ``token`` from ``state``; None where the constraint refuses it."""
        return self.index.get_next_state(state, token)

    def is_final(self, state: int) -> bool:
        """Whether the tokens up to ``state`` complete the regex (the stop tokens are allowed)."""
        return self.index.get_next_state(state, self.end_token) is not None

    def allowed_bits(self, state: int) -> torch.Tensor:
        bits = self._bits.get(state)
        if bits is None:
            allowed = torch.tensor([t for t in self.index.get_allowed_tokens(state) if t < self.vocab_size],
                                   dtype=torch.long)
            bits = self._bits[state] = pack_token_bits(allowed, self.vocab_size)
        return bits

    def matcher(self, stop_token_ids: tuple[int, ...]) -> GrammarMatcher:
        """A request's matcher; ``stop_token_ids`` are allowed where the regex is complete."""
        return GrammarMatcher(self, stop_token_ids)


def terminated_vocabulary(byte_strings: dict[bytes, list[int]], vocab_size: int) -> Any:
    """outlines-core's vocabulary of ``byte_strings`` (:func:`token_byte_strings`) and the token
    ``vocab_size`` spelling :data:`END_OF_MATCH`, for :meth:`Grammar.from_regex`. Its EOS id
    (``vocab_size + 1``) is never reached (nothing follows the end mark): the stop tokens are
    the engine's to allow (ConstraintMatcher)."""
    end = END_OF_MATCH.encode()
    # a token ending with a proper prefix of the mark (a byte-level BPE's lone leading byte
    # 0xF4, ...) could start spelling it, and one holding it could end the match mid-token:
    # left out, so constrained outputs never hold the U+100000-U+10FFFF plane's characters
    partial = tuple(end[:i] for i in range(1, len(end)))
    spelled = {b: list(ids) for b, ids in byte_strings.items() if not b.endswith(partial) and end not in b}
    spelled[end] = [vocab_size]
    return _backend().Vocabulary(vocab_size + 1, spelled)


def pack_token_bits(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``tokens [N]`` int64 (each < ``vocab_size``) as a ``[ceil(V / 32)]`` int32 bit set."""
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    # distinct tokens set distinct bits: a sum of powers of two is their OR
    words.index_add_(0, tokens // 32, torch.ones_like(tokens) << (tokens % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_token_bits(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bits [R, ceil(V / 32)]`` int32 -> ``[R, V]`` bool, True where a token's bit is set."""
    t = torch.arange(vocab_size, device=bits.device)
    return ((bits[:, t // 32] >> (t % 32)) & 1).bool()


class ConstraintMatcher:
    """One request's place in its constraint: the state its outputs reached (caught up lazily
    from ``outputs``), the bit sets of the rows a step scores, and the guided drafts. The
    backends (:class:`GrammarMatcher`, outlines-core's automaton; structured_cfg.CfgMatcher,
    llguidance's grammars) give a state that can take a token and give it back; the walks
    over drafts are written once, here.

    A stop token, or a token the constraint refuses, leaves it: past that (a stop token
    generated with ignore_eos, a refused draft) every token is allowed, since such a draft row
    is never used and past the constraint nothing is left to enforce."""

    def __init__(self, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.num_consumed = 0  # outputs the state has taken in
        self.is_left = False  # the outputs left the constraint
        self.stop_token_ids = frozenset(stop_token_ids)
        # (outputs, drafts, their rows' bit sets) of the last guided_drafts: the verify of the
        # same step reads the drafts and rows from here instead of from the device
        self._drafted: tuple[int, list[int], list[torch.Tensor]] | None = None
        stops = torch.tensor(sorted({t for t in stop_token_ids if 0 <= t < vocab_size}), dtype=torch.long)
        self._stop_bits = pack_token_bits(stops, vocab_size)
        self._has_stops = bool(self._stop_bits.any())

    # ---- the backend's state ----------------------------------------------------------
    def _advance(self, token: int) -> bool:
        """Take ``token`` into the state; False (the state unchanged) where it is refused."""
        raise NotImplementedError

    def _rewind(self, num_tokens: int) -> None:
        """Give back the last ``num_tokens`` tokens :meth:`_advance` took since the outputs."""
        raise NotImplementedError

    def _commit(self) -> None:
        """The tokens taken so far are outputs: never given back."""

    def _allowed_bits(self) -> torch.Tensor:
        """The vocabulary tokens the state allows, stop tokens aside (``[W]`` int32)."""
        raise NotImplementedError

    def _is_final(self) -> bool:
        """Whether the tokens so far complete the constraint (its stop tokens are allowed)."""
        raise NotImplementedError

    def _is_exhausted(self) -> bool:
        """Whether the state allows no vocabulary token (cheaply: it is asked every output)."""
        return not bool(self._allowed_bits().any())

    # ---- shared -----------------------------------------------------------------------
    def _catch_up(self, outputs: list[int]) -> None:
        for t in outputs[self.num_consumed:]:
            if not self.is_left and (t in self.stop_token_ids or not self._advance(t)):
                self.is_left = True
        self.num_consumed = len(outputs)
        self._commit()

    def _bits(self) -> torch.Tensor:
        """The tokens the state allows, its stop tokens too where it is final (``[W]`` int32)."""
        bits = self._allowed_bits()
        return bits | self._stop_bits if self._is_final() else bits

    def allows_only_stops(self, bits: torch.Tensor) -> bool:
        """Whether row ``bits`` (from :meth:`row_bits`) allows stop tokens only: the output is
        complete, and min_tokens does not ban them there (the constraint wins)."""
        return not bool((bits & ~self._stop_bits).any())

    def allows_nothing(self, outputs: list[int]) -> bool:
        """Whether the constraint allows no token after ``outputs``: a complete output that
        cannot go on, when no stop token may end it (ignore_eos, no stop_token_ids), or a
        state the vocabulary cannot leave. The request ends there (Sequence.append_tokens);
        its next row would be all ``-inf``."""
        self._catch_up(outputs)
        if self.is_left:
            return False
        return self._is_exhausted() and not (self._has_stops and self._is_final())

    def guided_drafts(self, outputs: list[int], candidates: np.ndarray) -> list[int]:
        """Drafts that stay inside the constraint after ``outputs``: at each position ``j`` the
        first of ``candidates[j]`` (``[k, C]`` int64: the drafter's likeliest tokens, best first)
        the state allows (stop tokens where it is final); where none is allowed, or once a stop
        token was drafted or the state is gone, the position's likeliest (the target will not
        accept it: such drafts only fill the block). Changes which drafts are proposed, never
        what is accepted (the verify decides). The ``k + 1`` rows' bit sets the verify masks
        with are kept for :meth:`row_bits`."""
        self._catch_up(outputs)
        drafts, rows, num_taken, inside = [], [], 0, not self.is_left
        for choices in candidates:
            pick = int(choices[0])
            rows.append(self._bits() if inside else self._all_bits())
            if inside:
                allowed = rows[-1].numpy()
                ok = (allowed[choices // 32] >> (choices % 32)) & 1  # [C] in the state's bit set
                if ok.any():
                    pick = int(choices[int(ok.argmax())])
                # past a stop token nothing is verified; past a refused token nothing accepted
                inside = pick not in self.stop_token_ids and self._advance(pick)
                num_taken += inside
            drafts.append(pick)
        rows.append(self._bits() if inside else self._all_bits())
        self._rewind(num_taken)
        self._drafted = (len(outputs), drafts, rows)
        return drafts

    def drafted(self, num_outputs: int, num_drafts: int) -> list[int] | None:
        """The drafts :meth:`guided_drafts` chose after ``num_outputs`` outputs, if it chose
        ``num_drafts`` there; else None (the drafts were not guided: read them off the device)."""
        if self._drafted is None or self._drafted[0] != num_outputs or len(self._drafted[1]) != num_drafts:
            return None
        return self._drafted[1]

    def row_bits(self, outputs: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """``len(drafts) + 1`` bit sets: row ``j`` allows what the constraint allows after
        ``outputs`` then ``drafts[:j]`` (every token once they left it)."""
        if self._drafted is not None and self._drafted[0] == len(outputs) and self._drafted[1] == drafts:
            return self._drafted[2]
        self._catch_up(outputs)
        rows, num_taken, inside = [], 0, not self.is_left
        for j in range(len(drafts) + 1):
            if j and inside:
                inside = drafts[j - 1] not in self.stop_token_ids and self._advance(drafts[j - 1])
                num_taken += inside
            rows.append(self._bits() if inside else self._all_bits())
        self._rewind(num_taken)
        return rows

    def _all_bits(self) -> torch.Tensor:
        return torch.full_like(self._stop_bits, -1)


class GrammarMatcher(ConstraintMatcher):
    """A :class:`Grammar`'s matcher: the states are outlines-core's (ints), walked forwards on
    a stack and popped to give tokens back; each state's bit set is cached by the grammar."""

    def __init__(self, grammar: Grammar, stop_token_ids: tuple[int, ...]) -> None:
        super().__init__(grammar.vocab_size, stop_token_ids)
        self.grammar = grammar
        self._states = [grammar.initial_state]
        self._exhausted: dict[int, bool] = {}  # state -> allows no vocabulary token

    def _advance(self, token: int) -> bool:
        state = self.grammar.next_state(self._states[-1], token)
        if state is not None:
            self._states.append(state)
        return state is not None

    def _rewind(self, num_tokens: int) -> None:
        if num_tokens:
            del self._states[-num_tokens:]

    def _commit(self) -> None:
        del self._states[:-1]

    def _allowed_bits(self) -> torch.Tensor:
        return self.grammar.allowed_bits(self._states[-1])

    def _is_final(self) -> bool:
        return self.grammar.is_final(self._states[-1])

    def _is_exhausted(self) -> bool:
        state = self._states[-1]
        exhausted = self._exhausted.get(state)
        if exhausted is None:
            exhausted = self._exhausted[state] = not bool(self._allowed_bits().any())
        return exhausted


class StructuredOutputCompiler:
    """Compiles :class:`StructuredOutputsParams` against one tokenizer and model vocabulary,
    keeping the last ``max_cached`` grammars (compiling walks the whole vocabulary: ~ms per
    1k tokens and automaton states)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_cached: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compile_regex = functools.lru_cache(maxsize=max_cached)(self._compile_uncached)
        self._compile_grammar = functools.lru_cache(maxsize=max_cached)(self._compile_grammar_uncached)
        self._vocabulary = None
        self._tokenizer_text: str | None = None
        self._lock = threading.Lock()

    def vocabulary(self) -> Any:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = terminated_vocabulary(token_byte_strings(self.tokenizer, self.vocab_size),
                                                         self.vocab_size)
            return self._vocabulary

    def _compile_uncached(self, regex: str) -> Grammar:
        return Grammar.from_regex(regex, self.vocabulary(), self.vocab_size)

    def _compile_grammar_uncached(self, text: str) -> Any:
        from .structured_cfg import CfgGrammar, tokenizer_json

        with self._lock:
            if self._tokenizer_text is None:
                self._tokenizer_text = tokenizer_json(self.tokenizer)
        return CfgGrammar.compile(text, self._tokenizer_text, self.vocab_size,
                                  getattr(self.tokenizer, "eos_token_id", None))

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The grammar of ``params`` (a :class:`Grammar`, or structured_cfg.CfgGrammar for a
        ``grammar``); ValueError naming the field for a bad schema, regex or grammar, or for a
        counted repetition over :data:`MAX_REPETITION` (e.g. a schema's ``minItems``: each count
        is a copy of the piece in the automaton, and a server would compile it for minutes)."""
        if params.grammar is not None:
            return self._compile_grammar(params.grammar)
        try:
            regex = params.to_regex()
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.json: {e}") from None
        counts = [int(c) for m in _COUNTED.finditer(regex) for c in m.groups() if c]
        if counts and max(counts) > MAX_REPETITION:
            field = "regex" if params.regex is not None else "json"
            raise ValueError(f"StructuredOutputsParams.{field} repeats a piece {max(counts)} times, "
                             f"over the {MAX_REPETITION} this engine compiles (each repetition is a "
                             "copy in the automaton); lower the count (a schema's minItems, "
                             "maxItems, minLength, maxLength) or leave it unbounded")
        return self._compile_regex(regex)
