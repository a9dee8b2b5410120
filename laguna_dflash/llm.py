"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .chat_template import ChatTemplateError, read_chat_template, render_messages
from .config import (
    EngineConfig,
    SamplingParams,
    SpeculativeConfig,
    from_vllm_speculative_config,
    tokenize_bad_words,
    truncated_prompt,
    vllm_draft_quantization,
    vllm_k_schedule,
)
from .distributed import is_rank_zero
from .engine.engine import LLMEngine
from .engine.sampler import Logprob
from .engine.sequence import Sequence
from .generation_config import sampling_defaults
from .models.loader import CheckpointError
from .server.detokenizer import IncrementalDetokenizer, OutputText
from .structured_outputs import StructuredOutputCompiler

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """Result of one prompt. ``logprobs``: per generated token ``{token_id: Logprob}`` (the
    chosen token plus the top-n; a :class:`Logprob` is the float log-probability with vLLM's
    ``logprob``, ``rank`` and ``decoded_token`` fields); ``prompt_logprobs``: the same per prompt
    position (``None`` first);
    ``num_cached_tokens``: prompt tokens taken from the prefix cache instead of computed."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0
    # with ``SamplingParams.n > 1``: this is choice 0; the others (``index`` 1..n-1) are here
    index: int = 0
    # vLLM's: the stop string or stop token id the request stopped on (None for EOS, length)
    stop_reason: str | int | None = None
    other_choices: list[RequestOutput] = field(default_factory=list, repr=False)

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM-style access (``out.outputs[i].text``): the ``n`` choices, this one first."""
        return [self, *self.other_choices]

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the generated tokens' logprobs; None unless the request asked for
        ``logprobs`` (as vLLM's V1 engine)."""
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for t, lp in zip(self.token_ids, self.logprobs)))

    @property
    def finished(self) -> bool:
        """vLLM's ``RequestOutput.finished``: always True for what ``LLM.generate`` returns."""
        return self.finish_reason is not None


def _feed(text: OutputText, s: Sequence) -> bool:
    """Feed ``text`` the tokens of ``s`` it has not seen; True when a stop string ended it (then
    ``text.num_tokens`` is the tokens up to the one that completed it)."""
    text.add_tokens(s.output_token_ids[text.num_tokens:], s.is_finished and s.is_stopped_on_token)
    return text.stop_hit is not None


def _token_ids(ids) -> list[int]:
    """One prompt's token ids as ints; floats, strings and bools are errors, not converted."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt_token_ids: each prompt must be a list of token ids (ints), got {ids!r:.80}")
    ids = list(ids)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"prompt_token_ids must hold integer token ids, got {bad[:5]!r}")
    return [int(t) for t in ids]


def has_tokenizer(path: str | Path) -> bool:
    """``path`` holds a tokenizer :func:`load_tokenizer` can read."""
    path = Path(path)
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer via transformers' AutoTokenizer, or None if it has none."""
    if not has_tokenizer(path):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.warning("%s has a tokenizer but transformers is not installed; token ids only", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))


def _progress_bar(use_tqdm: bool | Callable, total: int):
    """``generate``'s progress bar (vLLM's ``use_tqdm``): None when off, on ranks other than 0
    of a tensor-parallel launch, or with no requests."""
    if use_tqdm is False or not total or not is_rank_zero():
        return None
    if use_tqdm is True:
        from tqdm import tqdm

        use_tqdm = tqdm
    return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _check_checkpoint_dir(name: str, path: str | Path, what: str) -> None:
    """``path`` is a directory, or a :class:`CheckpointError` naming the argument that gave it
    (the loader's own message says "model path" for the drafter too)."""
    if not Path(path).is_dir():
        why = "not a directory" if Path(path).exists() else "no such directory"
        raise CheckpointError(f"{name} {str(path)!r}: {why}; pass {what} (a local Hugging Face "
                              "checkpoint directory with config.json and *.safetensors)")


#: Keyword arguments of vLLM's ``LLM`` that this one does not take, and why.
_VLLM_ONLY_OPTIONS = {
    "tokenizer": "the tokenizer is read from model=",
    "speculative": "give the drafter as draft= or speculative_config=",
}
#: Keyword arguments of vLLM's ``LLM`` taken and ignored, so that vLLM scripts run unchanged:
#: they change nothing here (no checkpoint code is ever run; this LLM logs no periodic stats).
_VLLM_NO_OP_OPTIONS = ("trust_remote_code", "disable_log_stats")


def _check_engine_options(options: dict) -> None:
    """Every keyword argument past ``LLM``'s own is an :class:`EngineConfig` field (or one of
    :data:`_VLLM_NO_OP_OPTIONS`, removed from ``options``), else a ``TypeError`` naming it and
    the options there are."""
    for name in _VLLM_NO_OP_OPTIONS:
        if options.pop(name, None):
            logger.debug("LLM(%s=...): taken as in vLLM, changes nothing here", name)
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "speculative"}
    unknown = sorted(set(options) - known)
    if unknown:
        why = _VLLM_ONLY_OPTIONS.get(unknown[0])
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" ({why})" if why else "")
                        + f"; the engine options are {', '.join(sorted(known))}")


class LLM:
    """Offline batched generation with optional DFlash speculative decoding.

    ``LLM(model=DIR, draft=None, dtype="float32", device="cpu", max_model_len=None,
    num_speculative_tokens=None, adaptive_k=False, draft_tensor_parallel_size=None,
    draft_quantization=None, speculative_token_map=None, **engine_options)``; vLLM's ``speculative_config={"method": "dflash", "model": DIR,
    "num_speculative_tokens": K, "draft_tensor_parallel_size": N}`` may stand for ``draft``,
    ``num_speculative_tokens`` and ``draft_tensor_parallel_size`` (with tensor parallelism: 1
    replicates the drafter on every rank, the target's size shards it; unset: sharded where its
    widths divide the ranks), and its ``"num_speculative_tokens_per_batch_size": [[lo, hi, k],
    ...]`` drafts ``k`` tokens in a step of ``lo..hi`` requests (every batch size up to
    ``max_num_seqs`` in one range; or ``num_speculative_tokens_per_batch_size=``);
    ``adaptive_k`` picks
    K <= num_speculative_tokens per step from measured acceptance and step cost (0 = no drafting);
    ``draft_quantization="fp8"`` stores the drafter's MLP gate|up and lm_head copy as fp8 rows
    (models/fp8.py; drafts may change, the output does not); ``speculative_token_map=FILE``
    (SGLang's name) drafts among that file's token ids only (models/draft_vocab.py; drafts may
    change, the output does not); ``generation_config`` (vLLM's): where :meth:`generate`
    without ``sampling_params`` takes its defaults, ``"auto"`` the model's
    ``generation_config.json``, ``"vllm"`` / ``"none"`` none (``SamplingParams()``), or a
    directory holding a ``generation_config.json``; engine options are the fields of
    :class:`EngineConfig` (``block_size``, ``num_kv_blocks``, ``max_num_seqs``, ...).
    """

    def __init__(
        self,
        model: str,
        draft: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_model_len: int | None = None,
        num_speculative_tokens: int | None = None,
        adaptive_k: bool = False,
        simulate_acceptance_length: float | None = None,
        speculative_config: dict | None = None,
        draft_tensor_parallel_size: int | None = None,
        draft_quantization: str | None = None,
        speculative_token_map: str | None = None,
        num_speculative_tokens_per_batch_size: list | tuple | None = None,
        generation_config: str = "auto",
        **engine_options,
    ) -> None:
        _check_engine_options(engine_options)
        if not isinstance(model, (str, Path)):
            raise ValueError(f"model= must be the target checkpoint directory (a str or Path), got "
                             f"{model!r:.80}")
        if speculative_config is not None:  # vLLM's spelling of draft= / num_speculative_tokens=
            if (draft is not None or num_speculative_tokens is not None
                    or draft_tensor_parallel_size is not None):
                raise ValueError("give the drafter once: speculative_config= (vLLM's spelling) or "
                                 "draft= / num_speculative_tokens= / draft_tensor_parallel_size=, "
                                 "not both")
            draft, num_speculative_tokens, draft_tensor_parallel_size = from_vllm_speculative_config(
                speculative_config, "speculative_config=")
            if draft_quantization is not None:
                raise ValueError("give the drafter's quantization once: speculative_config's "
                                 '"quantization" (vLLM\'s spelling) or draft_quantization=, not both')
            draft_quantization = vllm_draft_quantization(speculative_config, "speculative_config=")
        schedule = num_speculative_tokens_per_batch_size
        if speculative_config is not None and "num_speculative_tokens_per_batch_size" in speculative_config:
            if schedule is not None:
                raise ValueError("give the K schedule once: speculative_config's "
                                 '"num_speculative_tokens_per_batch_size" or the keyword, not both')
            schedule = vllm_k_schedule(speculative_config, "speculative_config=")
        speculative = None
        if draft is not None:
            speculative = SpeculativeConfig(draft=str(draft), num_speculative_tokens=num_speculative_tokens,
                                            adaptive=adaptive_k, num_speculative_tokens_per_batch_size=schedule,
                                            simulate_acceptance_length=simulate_acceptance_length,
                                            draft_tensor_parallel_size=draft_tensor_parallel_size,
                                            draft_quantization=draft_quantization,
                                            speculative_token_map=(None if speculative_token_map is None
                                                                   else str(speculative_token_map)))
        else:  # these act on draft tokens: without a drafter they would silently do nothing
            for name, is_given in (("num_speculative_tokens", num_speculative_tokens is not None),
                                   ("draft_tensor_parallel_size", draft_tensor_parallel_size is not None),
                                   ("adaptive_k", adaptive_k),
                                   ("draft_quantization", draft_quantization is not None),
                                   ("speculative_token_map", speculative_token_map is not None),
                                   ("num_speculative_tokens_per_batch_size", schedule is not None),
                                   ("simulate_acceptance_length", simulate_acceptance_length is not None)):
                if is_given:
                    raise ValueError(f"{name} was given without draft=; pass a DFlash drafter directory")
        # the directories once the arguments agree (the loader's own message would say "model
        # path" for the drafter too)
        _check_checkpoint_dir("model=", model, "the target model's directory")
        if draft is not None:
            draft_name = "speculative_config's \"model\"" if speculative_config is not None else "draft="
            _check_checkpoint_dir(draft_name, draft, "the DFlash drafter's directory")
        self.generation_config = generation_config
        self._generation_defaults = sampling_defaults(generation_config, model, "generation_config=")
        self._default_sampling_params: SamplingParams | None = None
        self.config = EngineConfig(model=str(model), dtype=dtype, device=device,
                                   max_model_len=max_model_len, speculative=speculative,
                                   **engine_options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = load_tokenizer(model)
        self._grammar_compiler: StructuredOutputCompiler | None = None  # made on first use

    def get_default_sampling_params(self) -> SamplingParams:
        """What :meth:`generate` samples with when given no ``sampling_params`` (vLLM's): the
        ``generation_config.json`` fields ``temperature``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) over
        ``SamplingParams()``'s defaults, per ``generation_config=``."""
        if self._default_sampling_params is None:
            values = self._generation_defaults
            source = self.config.model if self.generation_config == "auto" else self.generation_config
            try:
                self._default_sampling_params = SamplingParams(**values)
            except ValueError as e:
                raise ValueError(f"{Path(source) / 'generation_config.json'}: {e}; fix the file, pass "
                                 "sampling_params=, or LLM(..., generation_config='vllm')") from e
            if values:
                logger.info("default sampling parameters from %s's generation_config.json: %s "
                            "(pass sampling_params= to override)", source, values)
        return self._default_sampling_params

    def get_tokenizer(self):
        """vLLM's ``LLM.get_tokenizer()``: the model's transformers tokenizer (read from
        ``model``), e.g. for ``apply_chat_template``; None where the checkpoint has none."""
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """Tokenize a text prompt the way vLLM's offline API and ``/v1/completions`` do (with
        the tokenizer's special tokens, e.g. BOS, when its post-processor adds them)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer; pass token ids instead of text (prompt_token_ids= or --prompt-ids)")
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | list[int] | None = None,
        use_tqdm: bool | Callable = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, vLLM-style ``{"prompt": ...}`` or
        ``{"prompt_token_ids": [...]}`` dicts, or token ids); one :class:`RequestOutput` each, in
        order. ``sampling_params=None``: :meth:`get_default_sampling_params` (the model's
        ``generation_config.json``, as vLLM). ``use_tqdm`` (vLLM's; off by default here): a
        progress bar of finished requests on stderr, or a ``tqdm``-like callable to make it.
        ``priority`` (vLLM's): one integer a prompt, lower scheduled first; needs
        ``LLM(..., scheduling_policy="priority")`` unless all are 0."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts= (text) or prompt_token_ids=")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if prompts is not None and not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of them, got "
                             f"{type(prompts).__name__}; pass token ids as prompt_token_ids=")
        texts: list[str | None] = []
        token_lists: list[list[int]] = []
        salts: list[str | None] = []  # vLLM's per-prompt cache_salt
        if prompts is not None:
            for p in prompts:
                salt = p.get("cache_salt") if isinstance(p, dict) else None
                if salt is not None and not (isinstance(salt, str) and salt):
                    raise ValueError(f"a prompt's cache_salt must be a non-empty string, got {salt!r:.80}")
                salts.append(salt)
                if isinstance(p, dict) and "prompt_token_ids" in p:
                    texts.append(p.get("prompt"))
                    token_lists.append(_token_ids(p["prompt_token_ids"]))
                elif isinstance(p, dict) and isinstance(p.get("prompt"), str):
                    texts.append(p["prompt"])
                    token_lists.append(self.encode(p["prompt"]))
                elif isinstance(p, str):
                    texts.append(p)
                    token_lists.append(self.encode(p))
                else:
                    is_ids = isinstance(p, (numbers.Integral, list, tuple)) or hasattr(p, "tolist")
                    hint = "; pass token ids as prompt_token_ids=" if is_ids else ""
                    raise ValueError(f"a prompt must be a string, {{'prompt': str}} or "
                                     f"{{'prompt_token_ids': [int, ...]}}; got {p!r:.80}{hint}")
        else:
            if hasattr(prompt_token_ids, "tolist"):  # a numpy array or a tensor
                prompt_token_ids = prompt_token_ids.tolist()
            if isinstance(prompt_token_ids, str):
                raise ValueError("prompt_token_ids must be a list of token ids (ints) or a list of "
                                 "such lists, got a string; pass text as prompts=")
            if prompt_token_ids and isinstance(prompt_token_ids[0], numbers.Integral):
                prompt_token_ids = [prompt_token_ids]
            token_lists = [_token_ids(t) for t in prompt_token_ids]
            texts = [None] * len(token_lists)
        return self._generate(token_lists, texts, sampling_params, use_tqdm, salts, priority)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: ``messages`` is one conversation (a list of ``{"role": ...,
        "content": ...}`` dicts; content a string or OpenAI text parts) or a list of them. Each
        is rendered by the tokenizer's chat template, or ``chat_template`` (the template text or
        a file holding it), by the renderer ``/v1/chat/completions`` uses
        (:func:`~laguna_dflash.chat_template.render_messages`: ``add_generation_prompt`` unless
        ``continue_final_message``, ``tools`` and ``chat_template_kwargs`` passed to the
        template), tokenized without adding special tokens (the template writes them), and
        generated from as :meth:`generate` does: one :class:`RequestOutput` per conversation,
        whose ``prompt`` is the rendered text."""
        if self.tokenizer is None:
            raise ValueError(f"LLM.chat needs a tokenizer, and {self.config.model} has none; use "
                             "generate(prompt_token_ids=...)")
        if (isinstance(messages, (list, tuple)) and messages
                and all(isinstance(m, dict) for m in messages)):
            conversations = [list(messages)]
        elif isinstance(messages, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in messages):
            conversations = [list(c) for c in messages]
        else:
            raise ValueError('messages must be a conversation (a list of {"role": ..., "content": ...} '
                             f"dicts) or a list of conversations, got {messages!r:.80}")
        template = read_chat_template(chat_template, "chat_template=")
        texts = []
        for conversation in conversations:
            try:
                texts.append(render_messages(
                    self.tokenizer, conversation, chat_template=template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools,
                    chat_template_kwargs=chat_template_kwargs))
            except ChatTemplateError as e:
                hint = ("; pass chat_template= (the template text or a file holding it)"
                        if e.field == "chat_template" else "")
                raise ValueError(f"LLM.chat {e.field}: {e}{hint}") from e
        token_lists = [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        return self._generate(token_lists, texts, sampling_params, use_tqdm)

    def _generate(self, token_lists: list[list[int]], texts: list[str | None],
                  sampling_params: SamplingParams | list[SamplingParams] | None,
                  use_tqdm: bool | Callable, salts: list[str | None] | None = None,
                  priority: list[int] | None = None) -> list[RequestOutput]:
        """:meth:`generate` and :meth:`chat` past their inputs: the prompts as token ids (their
        texts, or None, for the outputs), the sampling parameters as given to them; ``salts``:
        a prompt's own ``cache_salt`` (over its parameters'); ``priority``: one a prompt."""
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(token_lists)):
            raise ValueError(f"priority must be a list of one integer a prompt ({len(token_lists)}), "
                             f"got {priority!r:.80}")
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(token_lists)
        bad = [p for p in params_list if not isinstance(p, SamplingParams)]
        if bad:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(bad[0]).__name__}")
        if len(params_list) != len(token_lists):
            raise ValueError(
                f"got {len(params_list)} sampling_params for {len(token_lists)} prompts; pass one or one each"
            )
        params_list = [p if not salt else replace(p, cache_salt=salt)
                       for p, salt in zip(params_list, salts or [None] * len(params_list))]
        if self.tokenizer is None and any(p.stop for p in params_list):
            raise ValueError(f"SamplingParams.stop: {self.config.model} has no tokenizer to find stop "
                             "strings with; use stop_token_ids")
        params_list = self._with_grammars(self._with_bad_words_ids(params_list))
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise ValueError(f"use_tqdm must be True, False or a tqdm-like callable, got {use_tqdm!r:.80}")
        seqs: list[list[Sequence]] = []  # per prompt, its n choices
        bar = None
        texts_of: dict[int, OutputText] = {}  # request id -> its text, requests with stop strings
        # Every request of this call leaves the engine when the call does: an invalid prompt
        # (add_request), a failing step (StepError) or an interrupt aborts the ones not finished,
        # so none of them runs (and holds KV blocks) inside a later generate()
        try:
            for ids, p, t, rank in zip(token_lists, params_list, texts, priority or [0] * len(token_lists)):
                ids = truncated_prompt(ids, p.truncate_prompt_tokens, self.engine.max_model_len)
                seqs.append([])
                for i in range(p.n):  # choice i samples with seed + i, as the server's n
                    choice = p if i == 0 or p.seed is None else replace(p, seed=p.seed + i)
                    seq = self.engine.add_request(ids, choice, prompt=t, priority=rank)
                    seqs[-1].append(seq)
                    if p.stop:
                        texts_of[seq.request_id] = OutputText(
                            IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens), p.stop or (),
                            p.include_stop_str_in_output, p.min_tokens)
            watched = [s for choices in seqs for s in choices if s.params.stop]
            bar = _progress_bar(use_tqdm, sum(len(c) for c in seqs))
            while self.engine.has_unfinished:
                self.engine.step()
                for s in watched:  # a stop string ends the request at the token that completed it
                    text = texts_of[s.request_id]
                    if text.stop_hit is None and _feed(text, s):
                        if not s.is_finished:
                            self.engine.abort(s)
                        del s.output_token_ids[text.num_tokens:]  # a verify's tokens past it
                if bar is not None:
                    bar.update(sum(s.is_finished for c in seqs for s in c) - bar.n)
        except BaseException:
            for s in (s for choices in seqs for s in choices if not s.is_finished):
                self.engine.abort(s)
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = []
        for choices in seqs:
            first, *others = [replace(self._output(s, texts_of.get(s.request_id)), index=i)
                              for i, s in enumerate(choices)]
            outputs.append(replace(first, other_choices=others))
        return outputs

    def _with_bad_words_ids(self, params_list: list[SamplingParams]) -> list[SamplingParams]:
        """Each ``SamplingParams`` with ``bad_words`` gets their token ids
        (``bad_words_token_ids``, :func:`~laguna_dflash.config.tokenize_bad_words` with this
        model's tokenizer), which the engine bans; each distinct list is tokenized once."""
        if not any(p.bad_words for p in params_list):
            return params_list
        if self.tokenizer is None:
            raise ValueError(f"SamplingParams.bad_words: {self.config.model} has no tokenizer to "
                             "tokenize the words with; pass their token ids as bad_words_token_ids")
        ids: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}
        out = []
        for p in params_list:
            if p.bad_words:
                key = tuple(p.bad_words)
                if key not in ids:
                    ids[key] = tokenize_bad_words(self.tokenizer, p.bad_words)
                p = replace(p, bad_words_token_ids=ids[key])
            out.append(p)
        return out

    def _with_grammars(self, params_list: list[SamplingParams]) -> list[SamplingParams]:
        """Each ``SamplingParams`` with ``structured_outputs`` and no ``structured_grammar`` gets
        it compiled with this model's tokenizer (one compiler an LLM, which keeps the recent
        grammars); the engine enforces it. A grammar given is used as it is."""
        if not any(p.structured_outputs is not None and p.structured_grammar is None for p in params_list):
            return params_list
        if self.tokenizer is None:
            raise ValueError(f"SamplingParams.structured_outputs: {self.config.model} has no "
                             "tokenizer to compile the constraint with; leave it out")
        if self._grammar_compiler is None:
            self._grammar_compiler = StructuredOutputCompiler(self.tokenizer, self.engine.target.spec.vocab_size)
        return [replace(p, structured_grammar=self._grammar_compiler.compile(p.structured_outputs))
                if p.structured_outputs is not None and p.structured_grammar is None else p
                for p in params_list]

    def _output(self, s: Sequence, text: OutputText | None) -> RequestOutput:
        """``s`` as a :class:`RequestOutput`. Its text leaves out the text of the token the
        engine stopped on (EOS or a stop token id) unless ``include_stop_str_in_output``, as in
        vLLM; ``text``: the :class:`OutputText` of a request with stop strings (fed the rest of
        its tokens here; its text ends before the first stop string found)."""
        metrics = {}
        if self.engine.proposer is not None:
            drafts = s.num_drafts
            metrics = {
                "num_drafts": drafts,
                "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(s.num_accepted_tokens_per_pos),
                "mean_acceptance_length": 1 + s.num_accepted_tokens / drafts if drafts else 0.0,
            }
            if s.trace:
                metrics["trace"] = s.trace
        finish, stop_reason = s.finish_reason, None
        tokens = list(s.output_token_ids)
        if text is not None and (text.stop_hit is not None or _feed(text, s)):
            finish, stop_reason = "stop", text.stop_hit
        elif text is not None:
            text.finish()
            if text.stop_hit is not None:  # in the tail held back until the end (an unfinished
                # multi-byte character): the text is cut there; the tokens stay, as the server
                # reports them (serving.generate), since the flush does not say which one
                finish, stop_reason = "stop", text.stop_hit
        if finish == "stop" and stop_reason is None and tokens and tokens[-1] in (
                s.params.stop_token_ids or ()):
            stop_reason = tokens[-1]
        if text is not None:
            out_text = text.text
        else:  # the engine's stop token adds no text (EOS is special and skipped anyway)
            shown = tokens[:-1] if s.is_stopped_on_token and not s.params.include_stop_str_in_output \
                else tokens
            out_text = self.decode(shown, s.params.skip_special_tokens)
        logprobs = s.logprobs if s.logprobs is None else self._decoded(s.logprobs[: len(tokens)])
        return RequestOutput(
            request_id=s.request_id, prompt=s.prompt, prompt_token_ids=s.prompt_token_ids,
            token_ids=tokens, text=out_text, finish_reason=finish,
            logprobs=logprobs, prompt_logprobs=self._decoded(s.prompt_logprobs), metrics=metrics,
            num_cached_tokens=s.num_cached_tokens, stop_reason=stop_reason,
        )

    def _decoded(self, entries: list[dict[int, Logprob] | None] | None) -> list[dict[int, Logprob] | None] | None:
        """``entries`` with each :class:`Logprob`'s ``decoded_token`` filled, as vLLM's offline
        outputs: the token decoded alone, special tokens kept (left None without a tokenizer)."""
        if entries is None or self.tokenizer is None:
            return entries
        texts: dict[int, str] = {}

        def text(token: int) -> str:
            if token not in texts:
                texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
            return texts[token]

        return [None if e is None else {t: Logprob(v, v.rank, text(t)) for t, v in e.items()}
                for e in entries]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (vLLM's ``LLM.reset_prefix_cache``)."""
        self.engine.reset_prefix_cache()

    def get_metrics(self) -> dict:
        """Engine-wide counters (spec decoding and timings)."""
        t = self.engine.timings
        out = {"prefill_s": t.prefill_s, "decode_s": t.decode_s,
               "num_prefill_tokens": t.num_prefill_tokens, "num_decode_tokens": t.num_decode_tokens,
               "num_steps": t.num_steps, "num_decode_steps": t.num_decode_steps,
               "prefix_cache_queries": self.engine.scheduler.num_prefix_queries,
               "prefix_cache_hits": self.engine.scheduler.num_prefix_hits}
        if self.engine.spec_stats is not None:
            out.update(self.engine.spec_stats.as_dict())
        return out
