"""Request fields -> :class:`SamplingParams`, with OpenAI/vLLM defaults and 400s for bad values."""

from __future__ import annotations

import logging
import math

from ..config import EngineConfig, SamplingParams
from .errors import bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

logger = logging.getLogger(__name__)

#: The default cap on a request's top log-probabilities (the engine's ``max_logprobs``; a server
#: takes ``--max-logprobs``, resolved as ``Serving.max_logprobs``).
MAX_LOGPROBS = EngineConfig.max_logprobs
#: Default ``max_tokens`` of a completion request (OpenAI and vLLM).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: The most choices one request may ask for (``n``).
MAX_CHOICES = 64
#: Seeds a request may send: a signed 64-bit integer (as vLLM); choice ``i`` of ``n`` samples
#: with ``seed + i``, whose bits mod 2**64 key the engine's noise (kernels/counter_noise.py).
SEED_RANGE = (-(2**63), 2**63 - 1)
#: Temperatures below this sample greedily (vLLM's): dividing float32 logits by less overflows.
MIN_TEMPERATURE = 1e-5


#: vLLM extension fields that change the output and that this server does not implement, with
#: the value that means "off" (also accepted): beam search. (Structured outputs' fields are
#: checked in server/structured.py.)
UNSUPPORTED_EXTENSIONS = {"use_beam_search": False}


def reject_unsupported(req: SamplingFields) -> None:
    """400 for fields whose non-default values this server cannot honour."""
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n={req.n}: the number of choices must be in [1, {MAX_CHOICES}]", "n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only for streamed responses: set stream=true or "
                          "leave stream_options out", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise bad_request(f"best_of={req.best_of} is not supported; leave best_of out or set it "
                              "to 1 (n gives several completions)", "best_of")
        if req.suffix:
            raise bad_request("suffix is not supported (no fill-in-the-middle); leave suffix out",
                              "suffix")
    if isinstance(req, ChatCompletionRequest):
        # tools and tool_choice: server/tool_calls.py (plan_tools)
        for name in ("functions", "function_call"):
            if getattr(req, name) not in (None, [], "none"):
                raise bad_request(f"{name} (OpenAI's deprecated function calling) is not "
                                  f"supported; leave {name} out", name)
        if req.echo:
            raise bad_request("echo on chat completions (vLLM's: the last message before the "
                              "reply) is not supported; leave echo out", "echo")
        # as vLLM: a generation prompt after a message left open to continue is a contradiction
        # (sent explicitly; its default True yields to continue_final_message)
        if (req.continue_final_message and req.add_generation_prompt
                and "add_generation_prompt" in req.model_fields_set):
            raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                              "true; leave add_generation_prompt out (or false) to continue the "
                              "last message", "add_generation_prompt")
    for name, default in UNSUPPORTED_EXTENSIONS.items():
        if getattr(req, name) not in (None, default):
            raise bad_request(f"{name} is not supported by this server; leave {name} out",
                              name)


def num_choices(req: SamplingFields) -> int:
    """``n``: the completions to generate for the prompt (each its own engine request)."""
    return req.n or 1


def stop_strings(req: SamplingFields) -> tuple[str, ...]:
    """The request's stop strings as a tuple (``stop`` may be one string or a list)."""
    if req.stop is None:
        return ()
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty", "stop")
    return stops


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, biases in [-100, 100]) -> ``{id:
    bias}``; 400 naming ``logit_bias`` for a key that is not a token id or a bias out of range
    (ids past the vocabulary are refused by the engine, also as a 400)."""
    if not raw:
        return None
    out = {}
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if token < 0 or not -100.0 <= _number(bias, "logit_bias") <= 100.0:
            raise bad_request(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got "
                              f"{key!r}: {bias}", "logit_bias")
        out[token] = float(bias)
    return out


def _number(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {value}", name)
    return float(value)


def num_prompt_logprobs(req: SamplingFields, max_logprobs: int, vocab_size: int) -> int | None:
    """vLLM's ``prompt_logprobs`` checked: None (off), or the count of most likely tokens each
    prompt position lists (-1: the whole vocabulary), within the server's ``--max-logprobs``."""
    n = req.prompt_logprobs
    if n is None:
        return None
    if req.stream:
        raise bad_request("prompt_logprobs are not available with stream=true (as in vLLM); "
                          "send the request without streaming, or leave prompt_logprobs out",
                          "prompt_logprobs")
    count = vocab_size if n == -1 else n
    if not 0 <= count <= max_logprobs:
        raise bad_request(f"prompt_logprobs must be in [0, {max_logprobs}] (the server's "
                          f"--max-logprobs) or -1 (the whole vocabulary, when --max-logprobs "
                          f"allows it), got {n}", "prompt_logprobs")
    return count


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       default: int | None, param: str = "max_tokens", allow_zero: bool = False,
                       cap: int | None = None) -> int:
    """The completion budget: the request's (checked against the context) or the default, at
    most ``cap`` (the ``generation_config.json``'s ``max_new_tokens``, as vLLM's server).

    ``default=None`` means "whatever the context leaves" (chat); a default never exceeds it.
    ``allow_zero``: 0 is accepted (completions with ``echo``: the prompt only).
    """
    budget = _budget(requested, num_prompt_tokens, max_model_len, default, param, allow_zero)
    return budget if cap is None else min(budget, cap)


def _budget(requested: int | None, num_prompt_tokens: int, max_model_len: int,
            default: int | None, param: str, allow_zero: bool) -> int:
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if requested < (0 if allow_zero else 1):
        hint = "" if allow_zero else " (0 is taken only by completions with echo)"
        raise bad_request(f"{param} must be at least {0 if allow_zero else 1}{hint}, got "
                          f"{requested}", param)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
            f"{requested} in the completion). Please reduce the length of the prompt or "
            f"{param}.", param)
    return requested


def build_sampling_params(req: SamplingFields, max_tokens: int, num_logprobs: int | None,
                          defaults: dict[str, float], logprobs_param: str = "logprobs",
                          max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
    """Validate the sampling fields and build the engine's :class:`SamplingParams`."""
    temperature = _number(req.temperature if req.temperature is not None
                          else defaults.get("temperature", 1.0), "temperature")
    if temperature < 0:
        raise bad_request(f"temperature must be >= 0 (0 = greedy), got {temperature}", "temperature")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise bad_request(f"seed must be a signed 64-bit integer in [{SEED_RANGE[0]}, "
                          f"{SEED_RANGE[1]}], got {req.seed}", "seed")
    top_p = _number(req.top_p if req.top_p is not None else defaults.get("top_p", 1.0), "top_p")
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = int(req.top_k if req.top_k is not None else defaults.get("top_k", 0))
    if top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (disabled) or >= 1, got {top_k}", "top_k")
    min_p = _number(req.min_p if req.min_p is not None else defaults.get("min_p", 0.0), "min_p")
    if not 0.0 <= min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1] (0 disables), got {min_p}", "min_p")
    if num_logprobs is not None and not 0 <= num_logprobs <= max_logprobs:
        raise bad_request(f"{logprobs_param} must be in [0, {max_logprobs}] (the server's "
                          f"--max-logprobs), got {num_logprobs}", logprobs_param)
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string (or left out: no salt)", "cache_salt")
    if req.stop_token_ids and any(t < 0 for t in req.stop_token_ids):
        raise bad_request("stop_token_ids must be non-negative token ids", "stop_token_ids")
    allowed = req.allowed_token_ids
    if allowed is not None and (not allowed or any(t < 0 for t in allowed)):
        # ids past the vocabulary are refused by Serving.start, which knows its size
        raise bad_request(f"allowed_token_ids must be a non-empty list of token ids >= 0 (leave it "
                          f"out to allow every token), got {[t for t in allowed if t < 0][:5] or allowed}",
                          "allowed_token_ids")
    bad_words = req.bad_words or None  # [] (vLLM's default) bans nothing
    if bad_words is not None and any(not w.strip() for w in bad_words):
        raise bad_request("bad_words must be non-empty words (not only whitespace), got "
                          f"{[w for w in bad_words if not w.strip()][:5]!r:.80}", "bad_words")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(getattr(req, name) or 0.0, name)
        if not -2.0 <= value <= 2.0:
            raise bad_request(f"{name} must be in [-2, 2] (0 disables), got {value}", name)
        penalties[name] = value
    if not 0 <= req.min_tokens <= max_tokens:
        raise bad_request(f"min_tokens must be in [0, max_tokens={max_tokens}], got {req.min_tokens}",
                          "min_tokens")
    repetition = _number(req.repetition_penalty if req.repetition_penalty is not None
                         else defaults.get("repetition_penalty", 1.0), "repetition_penalty")
    if not repetition > 0:
        raise bad_request(f"repetition_penalty must be > 0 (1 disables), got {repetition}",
                          "repetition_penalty")
    try:
        return SamplingParams(
            temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p,
            max_tokens=max_tokens,
            stop_token_ids=list(req.stop_token_ids) if req.stop_token_ids else None,
            ignore_eos=bool(req.ignore_eos), seed=req.seed, logprobs=num_logprobs,
            repetition_penalty=repetition, logit_bias=logit_bias(req.logit_bias), **penalties,
            min_tokens=req.min_tokens, cache_salt=req.cache_salt,
            allowed_token_ids=list(allowed) if allowed is not None else None,
            bad_words=list(bad_words) if bad_words is not None else None,
        )
    except ValueError as e:  # SamplingParams' own checks; the message names the field
        raise bad_request(str(e)) from e
