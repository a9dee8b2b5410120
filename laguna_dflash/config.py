"""Typed, frozen configuration objects.

Defaults live here once; the CLI and the offline API read them from these dataclasses.
User input errors raise ``ValueError`` with the field name and how to fix it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import sys
import typing
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def flag(name: str) -> str:
    """The command-line spelling of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def resolve_dtype(dtype: str | torch.dtype, model_config: dict | None = None,
                  device: torch.device | None = None) -> torch.dtype:
    """Map a user dtype spelling ("bfloat16", "bf16", torch.float32, ...) to a torch dtype.

    ``"auto"`` (vLLM's default spelling): the checkpoint's ``torch_dtype`` (``dtype`` in newer
    configs) on a GPU, bfloat16 if it names none or float32; float32 on the CPU (exact greedy
    agreement, and no bf16 matmul speed there). Without ``model_config`` it is only checked."""
    if isinstance(dtype, str) and dtype.lower() == "auto":
        if model_config is None or device is None or device.type == "cpu":
            return torch.float32
        named = model_config.get("torch_dtype") or model_config.get("dtype")
        chosen = _DTYPES.get(str(named).lower().removeprefix("torch."), torch.bfloat16)
        return torch.bfloat16 if chosen == torch.float32 else chosen
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; use one of float32, bfloat16, float16")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported (--dtype); use one of auto, float32, bfloat16, "
            "float16"
        )
    return _DTYPES[key]


def resolve_device(device: str | torch.device) -> torch.device:
    """``--device`` as a torch device with its index: ``"cuda"`` becomes the current CUDA device.

    The index matters beyond the loading thread: the server's engine thread selects its device
    with ``torch.cuda.set_device``, which refuses a CUDA device without one.
    """
    resolved = torch.device(device)
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was requested but CUDA is not available; use --device cpu")
    if resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s); use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return resolved


_KIND_NAMES = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def check_field_types(obj: object, skip: tuple[str, ...] = (),
                      names: dict[str, str] | None = None) -> None:
    """Each ``bool`` / ``int`` / ``float`` / ``str`` field of the dataclass ``obj`` holds that
    type (or None where its annotation allows it), else a ``ValueError`` naming the field and its
    flag: a string ``"16"`` would fail later in a comparison, a string ``"no"`` for a bool field
    would silently count as True. ``skip``: fields checked elsewhere; ``names``: the name a user
    gives a field by (``adaptive`` is ``adaptive_k``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        if base not in _KIND_NAMES:
            continue
        value = getattr(obj, f.name)
        if value is None and optional:
            continue
        if base is bool:
            ok = isinstance(value, bool)
        elif base is str:
            ok = isinstance(value, str)
        else:
            ok = (isinstance(value, numbers.Integral if base is int else numbers.Real)
                  and not isinstance(value, bool))
        if not ok:
            name = (names or {}).get(f.name, f.name)
            raise ValueError(f"{name} must be {_KIND_NAMES[base]}{' or None' if optional else ''} "
                             f"({flag(name)}), got {value!r:.80} ({type(value).__name__})")


#: The most completions per prompt (``SamplingParams.n``), as the server's ``n``.
MAX_N = 64

_SAMPLING_FIELD_TYPES = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"), numbers.Real),
    **dict.fromkeys(("top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs", "n"),
                    numbers.Integral),
}


#: vLLM's scheduling policies (``--scheduling-policy``)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM semantics). ``temperature < 1e-5`` (0 too) means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 (vLLM's spelling, stored as 0) disables top-k
    # keep tokens whose probability (after temperature) is at least min_p times the most
    # likely one's (vLLM's min_p; 0 disables)
    min_p: float = 0.0
    # None (vLLM's): no cap of its own, the sequence ends at max_model_len
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Applied to the logits of every generated position before temperature and the filters
    # (vLLM's order: logit_bias, then the penalties; engine/penalties.py). presence / frequency
    # (OpenAI): minus ``presence * [count > 0] + frequency * count`` over the tokens generated so
    # far; repetition (HF, vLLM's extra): a token seen in the prompt or the output has its logit
    # divided by it when positive, multiplied when not (> 1 discourages repeats);
    # logit_bias: ``{token id: bias}`` added to the logits. Logprobs stay the model's raw ones.
    # vLLM's min_tokens: the EOS token(s) (unless ignore_eos) and stop_token_ids cannot be
    # generated before this many output tokens (their logits are -inf there)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these token ids can be generated (every other token's logit
    # is -inf at every generated position, greedy and sampled; applied first, before min_tokens,
    # logit_bias and the penalties, as vLLM). A non-empty list of ids in the vocabulary; None
    # allows every token. Logprobs stay the model's raw ones.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: these words cannot be generated. Each word is tokenized as it would start
    # the text and, where that gives another first token and as many tokens, as it would follow
    # a space (tokenize_bad_words); the last token of such a sequence gets a -inf logit at every
    # position whose preceding OUTPUT tokens (the prompt is not looked at) end with the rest of
    # it, so a one-token word is banned everywhere. Applied right after allowed_token_ids (as
    # vLLM), greedy and sampled, lossless under speculation; logprobs stay the model's raw ones.
    # Non-empty strings (not only whitespace); None (or []) bans nothing. Needs a tokenizer.
    bad_words: list[str] | None = None
    # bad_words as token-id sequences, each ``(w_1, .., w_m)`` with every id >= 0: filled by
    # LLM.generate and the server from bad_words (tokenize_bad_words), as the engine has no
    # tokenizer; the engine applies these (engine/penalties.py). LLM.generate and the server
    # replace it where bad_words is set; set directly (engine.add_request, or LLM without
    # bad_words), it bans those sequences. Internal, as vLLM's ``_bad_words_token_ids``.
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # vLLM's completions per prompt (LLM.generate: one engine request each, choice i seeded with
    # seed + i; the engine itself ignores it)
    n: int = 1
    # vLLM's stop strings: the text ends before the first one found (after it with
    # include_stop_str_in_output), the request stops there. Text-level, so the engine ignores
    # them: LLM.generate (and the server, from its own request fields) watch the output text
    stop: tuple[str, ...] | list[str] | str | None = None
    include_stop_str_in_output: bool = False
    # vLLM's request field ``cache_salt``: a request's prompt blocks are cached and found under
    # hashes seeded with it, so only requests with the same salt share cached prefixes (one
    # salt per tenant keeps a tenant from timing its way to another's prompts). None: unsalted.
    # Changes no output.
    cache_salt: str | None = None
    # vLLM's: special tokens (EOS, chat-turn markers) are left out of the output text; False keeps
    # them (the token ids are the same either way)
    skip_special_tokens: bool = True
    # vLLM's: only the prompt's last this many tokens are used (-1: max_model_len of them);
    # None: the whole prompt (:func:`truncated_prompt`)
    truncate_prompt_tokens: int | None = None
    # vLLM's structured outputs: the output matches a JSON schema, a regex, one of a list of
    # strings, or is any JSON object (structured_outputs.StructuredOutputsParams, or a dict of
    # its fields); applied first with allowed_token_ids, greedy and sampled, lossless under
    # speculation. Needs a tokenizer and outlines-core (``laguna-dflash[structured]``).
    structured_outputs: typing.Any = None
    # structured_outputs compiled against the tokenizer (structured_outputs.Grammar): filled
    # by LLM.generate and the server, as the engine has no tokenizer. Internal.
    structured_grammar: typing.Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", sys.maxsize)
        for name, kind in _SAMPLING_FIELD_TYPES.items():
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs", "prompt_logprobs"):
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"SamplingParams.{name} must be "
                                 f"{'an integer' if kind is numbers.Integral else 'a number'}, got "
                                 f"{value!r} ({type(value).__name__})")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (isinstance(tpt, bool) or not isinstance(tpt, numbers.Integral)
                                or not (tpt == -1 or tpt >= 1)):
            raise ValueError(f"SamplingParams.truncate_prompt_tokens must be an integer >= 1, -1 "
                             f"(max_model_len) or None, got {tpt!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):  # "no" would count as True
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be True or False, got "
                                 f"{getattr(self, name)!r} ({type(getattr(self, name)).__name__})")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise ValueError(f"SamplingParams.cache_salt must be a non-empty string or None, got "
                             f"{self.cache_salt!r:.80}")
        if self.top_k == -1:  # vLLM's "disabled"
            object.__setattr__(self, "top_k", 0)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"SamplingParams.n must be in [1, {MAX_N}] (completions per prompt), "
                             f"got {self.n}")
        if not (self.temperature >= 0.0):
            raise ValueError(
                f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(
                f"SamplingParams.top_k must be >= 0 (0 or -1 disables top-k), got {self.top_k}"
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] (0 disables), got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"SamplingParams.{name} must be >= 0 or None, got {value}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2] (0 disables), got "
                                 f"{getattr(self, name)}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"SamplingParams.repetition_penalty must be finite and > 0 (1 "
                             f"disables), got {self.repetition_penalty}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids (e.g. "
                             f"[2], not 2), got {self.stop_token_ids!r:.80} "
                             f"({type(self.stop_token_ids).__name__})")
        bad_stops = [t for t in self.stop_token_ids or []
                     if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0]
        if bad_stops:
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids (ints >= 0), got "
                             f"{bad_stops[:5]}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop is not None and not (isinstance(self.stop, tuple)
                                          and all(isinstance(x, str) and x for x in self.stop)):
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, "
                             f"got {self.stop!r:.80}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got "
                             f"{type(self.logit_bias).__name__}")
        for token, bias in (self.logit_bias or {}).items():
            if (isinstance(token, bool) or not isinstance(token, int) or token < 0
                    or isinstance(bias, bool) or not isinstance(bias, numbers.Real)
                    or not -100.0 <= bias <= 100.0):
                raise ValueError(f"SamplingParams.logit_bias maps token ids (ints >= 0) to biases in "
                                 f"[-100, 100]; got {token!r}: {bias!r}")
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, (list, tuple)) or not allowed:
                raise ValueError(f"SamplingParams.allowed_token_ids must be a non-empty list of token "
                                 f"ids (e.g. [5, 9]; None allows every token), got {allowed!r:.80}")
            bad = [t for t in allowed if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0]
            if bad:
                raise ValueError(f"SamplingParams.allowed_token_ids must be token ids (ints >= 0), got "
                                 f"{bad[:5]}")
            object.__setattr__(self, "allowed_token_ids", [int(t) for t in allowed])
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not isinstance(words, (list, tuple)):
                raise ValueError(f"SamplingParams.bad_words must be a list of words (e.g. [\"foo\", "
                                 f"\"bar baz\"]), got {words!r:.80} ({type(words).__name__})")
            bad = [w for w in words if not isinstance(w, str) or not w.strip()]
            if bad:  # a word of whitespace only tokenizes to nothing once lstripped
                raise ValueError(f"SamplingParams.bad_words must be non-empty strings (not only "
                                 f"whitespace), got {bad[:5]!r:.80}")
            object.__setattr__(self, "bad_words", list(words) or None)
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            ok = isinstance(seqs, (list, tuple)) and all(
                isinstance(w, (list, tuple)) and w and all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in w)
                for w in seqs)
            if not ok:
                raise ValueError(f"SamplingParams.bad_words_token_ids must be a list of non-empty "
                                 f"token-id sequences (ints >= 0; filled from bad_words), got "
                                 f"{seqs!r:.80}")
            object.__setattr__(self, "bad_words_token_ids",
                               tuple(tuple(int(t) for t in w) for w in seqs) or None)
        if self.structured_outputs is not None:
            from .structured_outputs import StructuredOutputsParams
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (vLLM's epsilon: 1 / T would overflow float32)."""
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        """The logits are masked (structured outputs, allowed_token_ids, bad_words), biased or
        penalised before sampling (engine/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids or self.bad_words
                    or self.bad_words_token_ids or self.structured_outputs is not None)


def tokenize_bad_words(tokenizer: typing.Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as the token-id sequences the engine bans, with ``tokenizer``
    (``encode(text, add_special_tokens=False)``), the one implementation LLM.generate and the
    server share.

    Per word: the ids of ``word.lstrip()`` (the word starting the text); then the ids of ``" " +
    word.lstrip()`` (the word after a space, which many tokenizers spell with other tokens),
    kept only when they are as many as the first and begin with another token (vLLM's rule: a
    tokenizer that merges the space into the word's first token; a spaced form that is a space
    token followed by the bare word's tokens is covered by the bare one, which bans the word
    after any output token). Duplicates are dropped (they ban the same thing). A word that
    tokenizes to nothing is a ``ValueError`` naming ``SamplingParams.bad_words``."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = tuple(int(t) for t in tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ValueError(f"SamplingParams.bad_words: {word!r:.80} tokenizes to no tokens; "
                             "leave it out")
        out[bare] = None
        spaced = tuple(int(t) for t in tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out[spaced] = None
    return tuple(out)


def truncated_prompt(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: ``ids``' last that many tokens (-1: ``max_model_len``
    of them; None: all). A count past ``max_model_len`` is a ``ValueError`` naming the field."""
    if truncate_prompt_tokens is None:
        return ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if not 1 <= keep <= max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, "
                         f"{max_model_len}] (max_model_len), got {truncate_prompt_tokens}")
    return ids[-keep:]


#: The keys of vLLM's ``speculative_config`` this engine reads; others are logged and ignored.
VLLM_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
                         "quantization", "num_speculative_tokens_per_batch_size")
#: A K schedule by batch size: ``(first batch size, last batch size, K)`` ranges, inclusive.
KSchedule = tuple[tuple[int, int, int], ...]
DRAFT_QUANTIZATIONS = ("fp8",)  # SpeculativeConfig.draft_quantization (models/fp8.py)


def vllm_draft_quantization(cfg: dict, where: str) -> str | None:
    """vLLM's ``speculative_config["quantization"]`` (the drafter's quantization) -> "fp8" or
    None; ``where`` names it in errors."""
    value = cfg.get("quantization")
    if value is None or value in DRAFT_QUANTIZATIONS:
        return value
    raise ValueError(f"{where} quantization {value!r} is not supported for the drafter; use "
                     f"{' or '.join(map(repr, DRAFT_QUANTIZATIONS))} (weight-only, models/fp8.py) or leave it out")


def k_schedule(value: object, where: str) -> KSchedule:
    """vLLM's ``num_speculative_tokens_per_batch_size`` (``[[lo, hi, k], ...]``: a step of
    ``lo <= batch size <= hi`` requests drafts ``k`` tokens; 0 decodes without drafting) checked
    and sorted by ``lo``; ``where`` names it in errors. Ranges may not overlap; whether they
    cover every batch size the engine runs, and ``k <= num_speculative_tokens``, the engine
    checks (it knows both)."""
    example = "e.g. [[1, 4, 15], [5, 16, 7], [17, 256, 0]]"
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where} must be a non-empty list of [first batch size, last batch size, "
                         f"K] ranges, got {value!r:.80}; {example}")
    ranges = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) for v in item)):
            raise ValueError(f"{where}: each range is three integers [first batch size, last batch "
                             f"size, K], got {item!r:.80}; {example}")
        lo, hi, k = item
        if not 1 <= lo <= hi or k < 0:
            raise ValueError(f"{where}: range {list(item)} needs 1 <= first <= last batch size and "
                             f"K >= 0 (0: no drafting at those batch sizes); {example}")
        ranges.append((lo, hi, k))
    ranges.sort()
    for (lo, hi, _), (next_lo, next_hi, _) in zip(ranges, ranges[1:]):
        if next_lo <= hi:
            raise ValueError(f"{where}: ranges [{lo}, {hi}] and [{next_lo}, {next_hi}] overlap; give "
                             "each batch size one K")
    return tuple(ranges)


def vllm_k_schedule(cfg: dict, where: str) -> KSchedule | None:
    """vLLM's ``speculative_config["num_speculative_tokens_per_batch_size"]`` checked
    (:func:`k_schedule`), or None where it is left out."""
    value = cfg.get("num_speculative_tokens_per_batch_size")
    return None if value is None else k_schedule(value, f"{where} num_speculative_tokens_per_batch_size")


def from_vllm_speculative_config(cfg: object, where: str) -> tuple[str, int | None, int | None]:
    """vLLM's ``speculative_config`` (``{"method": "dflash", "model": DIR,
    "num_speculative_tokens": K, "draft_tensor_parallel_size": N}``) -> (drafter directory, K or
    None, N or None). ``where`` names it in errors (``--speculative-config``,
    ``speculative_config=``); other keys are logged and ignored."""
    example = '{"method": "dflash", "model": DIR, "num_speculative_tokens": 15}'
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must be a JSON object / dict, got {type(cfg).__name__}; e.g. {example}")
    method = str(cfg.get("method") or "dflash")
    if method.lower() != "dflash":
        raise ValueError(f"{where} method {method!r} is not supported; use \"dflash\"")
    if not cfg.get("model"):
        raise ValueError(f'{where} needs "model": the DFlash drafter directory; e.g. {example}')
    k = cfg.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):  # "3", 2.7: no silent cast
        raise ValueError(f"{where} num_speculative_tokens must be a JSON integer, got {k!r}; e.g. "
                         '"num_speculative_tokens": 15')
    draft_tp = cfg.get("draft_tensor_parallel_size")
    if draft_tp is not None and (isinstance(draft_tp, bool) or not isinstance(draft_tp, int)):
        raise ValueError(f"{where} draft_tensor_parallel_size must be a JSON integer (1: the "
                         f"drafter replicated, or the target's tensor_parallel_size), got {draft_tp!r}")
    ignored = sorted(set(cfg) - set(VLLM_SPECULATIVE_KEYS))
    if ignored:
        logging.getLogger(__name__).warning("%s: ignoring keys %s (not used by this engine)",
                                            where, ", ".join(ignored))
    return str(cfg["model"]), k, draft_tp


@dataclass(frozen=True)
class SpeculativeConfig:
    """DFlash speculative decoding settings.

    ``num_speculative_tokens`` is K, the number of MASK slots (draft tokens) per step; the drafter
    block holds K + 1 rows (the bonus token first). ``None`` means ``block_size - 1``.
    """

    draft: str
    num_speculative_tokens: int | None = None
    method: str = "dflash"
    adaptive: bool = False  # pick K <= num_speculative_tokens per step (engine/adaptive_k.py)
    # benchmarking only (SGLang's SGLANG_SIMULATE_ACC_LEN): accept drafts without checking so that
    # the mean acceptance length is this value; the output is then not the target's
    simulate_acceptance_length: float | None = None
    # with tensor parallelism (vLLM's key): 1 replicates the drafter on every rank; the target's
    # tensor_parallel_size shards its layers as the target's are; None: sharded where its heads
    # and MLP width divide the ranks, else replicated
    draft_tensor_parallel_size: int | None = None
    # "fp8": the drafter's MLP gate|up and its use of the shared lm_head as fp8 rows with fp32
    # scales (models/fp8.py: half the bytes those stream in CUDA launches of up to 16 rows, the
    # unquantized weights past them; drafts may change, the output does not); None: the
    # drafter in the engine's dtype
    draft_quantization: str | None = None
    # a token map file (SGLang's --speculative-token-map: a .pt of token ids, or a .json list):
    # the drafter drafts among these tokens only, reading their rows of the lm_head instead of
    # all of it (models/draft_vocab.py: drafts may change, the output does not); None: the
    # whole vocabulary
    speculative_token_map: str | None = None
    # vLLM's num_speculative_tokens_per_batch_size: K by the step's batch size, ranges
    # ``(lo, hi, k)`` (k <= num_speculative_tokens, every batch size up to max_num_seqs in one;
    # engine/adaptive_k.BatchSizeK); None: K every step (or adaptive K's choice)
    num_speculative_tokens_per_batch_size: KSchedule | None = None

    def __post_init__(self) -> None:
        check_field_types(self, skip=("draft_tensor_parallel_size", "speculative_token_map",
                                      "num_speculative_tokens_per_batch_size"),
                          names={"adaptive": "adaptive_k"})
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is not None:
            object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                               k_schedule(schedule, "num_speculative_tokens_per_batch_size"))
            if self.adaptive:
                raise ValueError("num_speculative_tokens_per_batch_size (a fixed K schedule) and "
                                 "adaptive_k (--adaptive-k: K chosen from measurements) both pick "
                                 "K each step; give one")
        if self.speculative_token_map is not None and not isinstance(self.speculative_token_map, str):
            raise ValueError("speculative_token_map must be a file path (str; --speculative-token-map), "
                             f"got {type(self.speculative_token_map).__name__}")
        if self.draft_quantization is not None and self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be 'fp8' or unset (--draft-quantization), got "
                             f"{self.draft_quantization!r}")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and (isinstance(dtp, bool) or not isinstance(dtp, int) or dtp < 1):
            raise ValueError("draft_tensor_parallel_size must be an integer >= 1 (--draft-tensor-"
                             "parallel-size: 1 replicates the drafter on every rank, the target's "
                             f"--tensor-parallel-size shards it), got {dtp!r}")
        if self.method.lower() != "dflash":
            raise ValueError(f"speculative method {self.method!r} is not supported; use 'dflash'")
        sim = self.simulate_acceptance_length
        if sim is not None and not (math.isfinite(sim) and sim >= 1):  # NaN passes a plain < 1
            raise ValueError(
                "simulate_acceptance_length must be a finite number >= 1 (--simulate-acceptance-"
                f"length; it counts the bonus token), got {sim}"
            )
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                "num_speculative_tokens must be >= 1 (--num-speculative-tokens; leave it unset "
                "for the drafter's block_size - 1), got "
                f"{self.num_speculative_tokens}"
            )


# The graphed batch cap when cuda_graph_max_bs is unset: max_num_seqs, at most this many. Every
# padded size up to the cap is captured (multiples of 8 past 8) times every key bucket and
# forward kind, ~0.2 s a graph at XS-2.1 size on the H200: uncapped, --max-num-seqs 1024 would
# capture ~130 batch sizes (thousands of graphs). SGLang caps its graphs the same way, vLLM by
# tokens (max_cudagraph_capture_size, 512).
DEFAULT_CUDA_GRAPH_MAX_BS = 256


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    ``max_model_len``: longest sequence (prompt + output); ``None`` = the model's
    ``max_position_embeddings`` capped at 8192. ``num_kv_blocks``: ``None`` sizes the cache for
    ``max_num_seqs`` full-length sequences. On CUDA, decode, verify and drafter-block forwards
    replay CUDA graphs (``engine/cuda_graph.py``) unless ``enforce_eager``.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (requests' priority,
    # lower first, then arrival; engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    speculative: SpeculativeConfig | None = None
    load_format: str = "auto"
    seed: int = 0
    trace: bool = False  # record, per spec step, anchor position, draft tokens, accepted count
    # the most logprobs / prompt_logprobs a request may ask for (vLLM's max_logprobs; -1: the
    # whole vocabulary)
    max_logprobs: int = 20
    # "auto": the paged Triton kernels on a GPU that runs them, else the torch SDPA reference
    attention_backend: str = "auto"  # | "torch_sdpa" | "triton"
    enforce_eager: bool = False  # True: no CUDA graphs for decode-phase forwards (vLLM's flag)
    # Also replay the drafter's decode-step context K/V precompute from CUDA graphs
    # (engine/context_graph.py; with CUDA graphs only, so not under enforce_eager). On the H200 at
    # XS-2.1 size it cut that phase from 0.82 to 0.23 ms per batch-1 step (docs/PERFORMANCE.md);
    # False keeps it eager, as DESIGN.md first planned (its row counts vary per step).
    graph_context_precompute: bool = True
    # "startup": after the warm-up, capture every padded batch size and key bucket of each
    # decode-phase forward kind the warm-up ran (as vLLM captures its batch sizes at start-up), so
    # no step later stalls for a capture; "lazy": capture a shape the first time a step needs it
    # (faster start-up; a new batch size, or a sequence crossing a key-length bucket, then waits).
    cuda_graph_capture: str = "startup"
    # The largest padded batch (requests) whose decode-phase forwards (decode, verify, drafter
    # block, drafter context) replay CUDA graphs; larger batches run eagerly. None: max_num_seqs,
    # at most DEFAULT_CUDA_GRAPH_MAX_BS (graph_batch_cap).
    # Start-up captures every padded batch size up to it (1, 2, 4, 8, 16, ...: capture_batch_sizes)
    # times every key bucket, ~0.2 s a graph at XS-2.1 size on the H200 (docs/PERFORMANCE.md,
    # thirty-seventh pass), so a lower cap starts faster and holds less graph memory (SGLang's
    # --cuda-graph-max-bs; vLLM's max_cudagraph_capture_size counts tokens instead).
    cuda_graph_max_bs: int | None = None
    # On a GPU, with num_kv_blocks unset: the fraction of the device's memory the weights and
    # the KV cache hold together (SGLang's --mem-fraction-static); the rest is left for
    # activations, CUDA graphs and other processes. None: the KV cache takes 80% of the memory
    # free after the weights load (kv_cache_budget_bytes).
    mem_fraction_static: float | None = None
    # On a GPU, with num_kv_blocks unset: the fraction of the device's memory the weights, the
    # activations of the largest forward (profiled at start-up: a prefill of
    # max_num_batched_tokens tokens, then sampling the largest verify batch) and the KV cache
    # hold together (vLLM's --gpu-memory-utilization; engine/memory_profile.py). CUDA graph pools
    # are not counted, as in vLLM. At most one of the two fractions may be set.
    gpu_memory_utilization: float | None = None
    # Every target forward with the batch-invariant kernels (kernels/batch_invariant.py): a
    # position's logits bitwise the same in any batch, prefill, decode or verify, so greedy DFlash
    # equals target-only token for token in bf16 too (vLLM's VLLM_BATCH_INVARIANT). Slower
    # (docs/PERFORMANCE.md); needs the Triton kernels (a CUDA GPU, sm80+).
    batch_invariant: bool = False
    # Ranks the target is sharded over (distributed.py: heads, expert widths and vocabulary
    # split, one all-reduce after each row-parallel projection). > 1 needs one process per rank,
    # launched like torchrun; on CUDA each rank takes the GPU of its LOCAL_RANK.
    tensor_parallel_size: int = 1
    # With tensor_parallel_size > 1: split the routed experts by expert (each rank holds
    # num_experts / tensor_parallel_size whole experts) instead of every expert's width (vLLM's
    # --enable-expert-parallel). Attention, dense MLPs, the shared expert and the vocabulary stay
    # tensor-parallel; the MoE keeps its one all-reduce. No effect on one rank.
    enable_expert_parallel: bool = False
    # Automatic prefix caching (vLLM's, on by default there too): full KV blocks are kept under
    # a hash of their token prefix after their request ends, and a later prompt starting with
    # the same tokens shares them and prefills only the rest (engine/scheduler.py). The drafter's
    # context K/V lives in the same blocks, so DFlash reuses it as well.
    enable_prefix_caching: bool = True
    # Chunked prefill (vLLM's, on by default there too): a prefill step computes at most
    # max_num_batched_tokens tokens; a longer prompt is computed in chunks over several steps,
    # alternating with the running requests' decode steps. False: every prompt is computed whole
    # in one step (the budget then grows to max_model_len).
    enable_chunked_prefill: bool = True
    # vLLM's hybrid KV cache manager is on unless this is set (its flag's name): a target with
    # both full and sliding-window layers (Laguna: 10 + 30 at XS-2.1) keeps the sliding layers'
    # K/V only within their window, so a long context costs the full layers' K/V per token
    # (engine/kv_cache.HybridLayout). True: every layer keeps every position (the unified layout).
    disable_hybrid_kv_cache_manager: bool = False
    # A prefill step of at most engine/cuda_graph.MAX_PREFILL_GRAPH_REQUESTS (4) requests replays
    # a CUDA graph when its requests padded to the longest one's token bucket (8, 16, .., a power
    # of two) hold at most this many tokens; larger prefills run eagerly (vLLM's
    # max_cudagraph_capture_size plays this part). Eager, a short prefill waits on the host's
    # launches (XS-2.1 size on the H200: 16 tokens 31 ms wall for 8 ms of kernels,
    # docs/PERFORMANCE.md; a 1024-token prefill 99.6 ms eager against 49.3 from a graph). 0: every
    # prefill eager. No effect under enforce_eager.
    max_prefill_graph_tokens: int = 2048

    @property
    def graph_batch_cap(self) -> int:
        """The largest padded batch (requests) whose decode-phase forwards replay CUDA graphs:
        ``cuda_graph_max_bs``, or ``DEFAULT_CUDA_GRAPH_MAX_BS`` when unset, at most
        ``max_num_seqs``."""
        cap = DEFAULT_CUDA_GRAPH_MAX_BS if self.cuda_graph_max_bs is None else self.cuda_graph_max_bs
        return min(cap, self.max_num_seqs)

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):  # as torch takes it; stored as its string
            object.__setattr__(self, "device", str(self.device))
        check_field_types(self, skip=("dtype",))  # dtype: a string or a torch.dtype
        resolve_dtype(self.dtype)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1 (--tensor-parallel-size), got "
                             f"{self.tensor_parallel_size}")
        if self.attention_backend not in ("auto", "torch_sdpa", "triton"):
            raise ValueError(f"attention_backend={self.attention_backend!r} is not supported "
                             "(--attention-backend); use 'auto', 'torch_sdpa' or 'triton'")
        if self.cuda_graph_capture not in ("startup", "lazy"):
            raise ValueError(f"cuda_graph_capture={self.cuda_graph_capture!r} is not supported "
                             "(--cuda-graph-capture); use 'startup' or 'lazy'")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1 (--cuda-graph-max-bs; leave it unset to "
                             f"graph every batch up to --max-num-seqs, or use --enforce-eager for no "
                             f"CUDA graphs), got {self.cuda_graph_max_bs}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1] (--mem-fraction-static: the share "
                             f"of GPU memory for weights and KV cache, e.g. 0.85), got "
                             f"{self.mem_fraction_static}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (--gpu-memory-utilization: "
                             f"the share of GPU memory for weights, activations and KV cache, e.g. "
                             f"0.9), got {self.gpu_memory_utilization}")
        if self.gpu_memory_utilization is not None and self.mem_fraction_static is not None:
            raise ValueError("gpu_memory_utilization (--gpu-memory-utilization, vLLM's: activations "
                             "inside the fraction) and mem_fraction_static (--mem-fraction-static, "
                             "SGLang's: activations on top) both size the KV cache; set one")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 (--block-size: tokens per KV block, e.g. "
                             f"16), got {self.block_size}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary "
                             f"(--max-logprobs), got {self.max_logprobs}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 (--num-kv-blocks; leave it unset to size the "
                             f"cache from max_num_seqs), got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (--max-model-len: prompt plus output "
                             f"tokens; leave it unset for the model's), got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1 (--max-num-batched-tokens), got "
                             f"{self.max_num_batched_tokens}")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError(f"max_prefill_graph_tokens must be >= 0 (--max-prefill-graph-tokens; 0 "
                             f"keeps every prefill eager), got {self.max_prefill_graph_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (--max-num-seqs: requests decoded "
                             f"together), got {self.max_num_seqs}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)} "
                             f"(--scheduling-policy), got {self.scheduling_policy!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} is not supported (--load-format); "
                             "use 'auto' or 'dummy'")
        try:
            device_type = torch.device(self.device).type
        except RuntimeError:  # torch's own message lists every device type it knows
            device_type = None
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not supported (--device); use 'cpu' or "
                             "'cuda[:N]'")
