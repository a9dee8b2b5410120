"""``laguna-dflash serve`` flags and the one function that resolves (and logs) the configuration.

Speculative decoding can be configured in three spellings, which all fill one
:class:`SpeculativeConfig`:

- ours: ``--draft DIR [--num-speculative-tokens K]``;
- vLLM: ``--speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens": K}'``;
- SGLang: ``--speculative-algorithm DFLASH --speculative-draft-model-path DIR
  --speculative-num-draft-tokens N`` where N is the verify width, i.e. the block size, which
  INCLUDES the bonus slot: K = N - 1 (``--speculative-dflash-block-size`` is a synonym).

Spellings may be mixed as long as they agree; two flags giving different values are an error that
names both flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..chat_template import read_chat_template
from ..config import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DRAFT_QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
    SpeculativeConfig,
    from_vllm_speculative_config,
    vllm_draft_quantization,
    vllm_k_schedule,
)
from ..engine.memory_profile import DEFAULT_KV_SHARE_OF_FREE
from ..generation_config import sampling_defaults
from ..models.dflash import dflash_value
from .tool_calls import TOOL_CALL_PARSERS, check_tool_call_parser

logger = logging.getLogger(__name__)

API_KEY_ENV = "LAGUNA_DFLASH_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # read after ours, so a vLLM deployment's key carries over


@dataclass(frozen=True)
class SpeculativeChoice:
    """Where the speculative settings came from (for the start-up log and /server_info)."""

    config: SpeculativeConfig | None
    draft_flag: str | None = None
    tokens_flag: str | None = None
    block_size: int | None = None  # the drafter's, when its config.json could be read


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``serve`` needs, resolved once from the command line."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    served_model_name: str = ""
    # --served-model-name's further names: requests may name them too (responses say the first)
    served_model_aliases: tuple[str, ...] = ()
    tokenizer: str | None = None
    generation_defaults: dict = field(default_factory=dict)
    log_stats_interval_s: float = 10.0
    uvicorn_log_level: str = "warning"
    speculative: SpeculativeChoice = field(default_factory=lambda: SpeculativeChoice(None))
    # the Jinja chat template to use instead of the tokenizer's (``--chat-template``), as text
    chat_template: str | None = field(default=None, repr=False)
    trust_request_chat_template: bool = False
    # vLLM's ``--enable-request-id-headers``: an ``X-Request-Id`` header on every response
    enable_request_id_headers: bool = False
    # vLLM's ``--enable-log-requests``: one INFO line per request (id, prompt length, params)
    log_requests: bool = False
    # --structured-outputs-config's request defaults ({"disable_any_whitespace": True} or {})
    structured_outputs_defaults: dict = field(default_factory=dict)
    # vLLM's --enable-auto-tool-choice and --tool-call-parser: tool_choice "auto" (tools sent
    # without a tool_choice too) parses the model's tool calls out of its text
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def describe(self) -> dict:
        """The resolved settings as plain values (logged at start-up, shown by /server_info)."""
        e = self.engine
        spec = self.speculative
        k = None
        if spec.config is not None:
            k = spec.config.num_speculative_tokens
            if k is None and spec.block_size is not None:
                k = spec.block_size - 1
        return {
            "model": e.model,
            "served_model_name": self.served_model_name,
            "served_model_aliases": list(self.served_model_aliases),
            "tokenizer": self.tokenizer,
            "host": self.host,
            "port": self.port,
            "api_key": "set" if self.api_key else "none",
            "dtype": e.dtype,
            "device": e.device,
            "max_model_len": e.max_model_len or "auto (model limit, at most 8192)",
            "block_size": e.block_size,
            "num_kv_blocks": e.num_kv_blocks or "auto",
            "mem_fraction_static": e.mem_fraction_static or (
                "unset" if e.gpu_memory_utilization
                else f"auto ({DEFAULT_KV_SHARE_OF_FREE:.0%} of the memory free after load)"),
            "gpu_memory_utilization": e.gpu_memory_utilization or "unset",
            "max_num_seqs": e.max_num_seqs,
            "max_num_batched_tokens": e.max_num_batched_tokens,
            "attention_backend": e.attention_backend,
            "enforce_eager": e.enforce_eager,
            "cuda_graph_capture": e.cuda_graph_capture,
            "cuda_graph_max_bs": e.cuda_graph_max_bs or (
                f"max_num_seqs, at most {DEFAULT_CUDA_GRAPH_MAX_BS} ({e.graph_batch_cap})"),
            "load_format": e.load_format,
            "batch_invariant": e.batch_invariant,
            "tensor_parallel_size": e.tensor_parallel_size,
            "enable_expert_parallel": e.enable_expert_parallel,
            "enable_prefix_caching": e.enable_prefix_caching,
            "enable_chunked_prefill": e.enable_chunked_prefill,
            "disable_hybrid_kv_cache_manager": e.disable_hybrid_kv_cache_manager,
            "max_prefill_graph_tokens": e.max_prefill_graph_tokens,
            "speculative_method": "dflash" if spec.config is not None else "off",
            "draft": spec.config.draft if spec.config is not None else None,
            "draft_from": spec.draft_flag,
            "draft_quantization": spec.config.draft_quantization if spec.config is not None else None,
            "speculative_token_map": spec.config.speculative_token_map if spec.config is not None else None,
            "num_speculative_tokens": k if k is not None else (
                "drafter block_size - 1" if spec.config is not None else 0),
            "num_speculative_tokens_per_batch_size": (
                [list(r) for r in spec.config.num_speculative_tokens_per_batch_size]
                if spec.config is not None and spec.config.num_speculative_tokens_per_batch_size
                else None),
            "num_speculative_tokens_from": spec.tokens_flag or (
                "drafter block_size" if spec.config is not None else None),
            "draft_tensor_parallel_size": (
                None if spec.config is None or e.tensor_parallel_size == 1
                else spec.config.draft_tensor_parallel_size
                or "auto (the target's where the drafter's widths divide it, else 1)"),
            "generation_defaults": dict(self.generation_defaults),
            "log_stats_interval_s": self.log_stats_interval_s,
            "chat_template": "--chat-template" if self.chat_template else "the tokenizer's",
            "trust_request_chat_template": self.trust_request_chat_template,
            "enable_request_id_headers": self.enable_request_id_headers,
            "log_requests": self.log_requests,
            "enable_auto_tool_choice": self.enable_auto_tool_choice,
            "tool_call_parser": self.tool_call_parser,
        }


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``serve`` beyond the shared engine flags (``cli.add_engine_args``)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback; use 0.0.0.0 to expose the server)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV}, or vLLM's "
                        f"${VLLM_API_KEY_ENV})")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send (default: the --model argument); with "
                        "several, requests may name any, responses carry the first (vLLM's)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="most requests decoded together")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig.max_num_batched_tokens, help="prefill token budget per step")
    p.add_argument("--scheduling-policy", default=EngineConfig.scheduling_policy,
                   choices=SCHEDULING_POLICIES,
                   help="fcfs: requests in arrival order; priority: by the request's priority "
                        "field (lower first), then arrival (vLLM's)")
    p.add_argument("--seed", type=int, default=EngineConfig.seed, help="engine sampling seed")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for fields a request leaves out: auto (the model's "
                        "generation_config.json), vllm or none (no defaults), or a directory "
                        "holding a generation_config.json (vLLM's choices)")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between engine / SpecDecoding log lines while busy (0: off)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file, or the template itself) to use instead of "
                        "the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat_template (off: such requests get a 400)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="add an X-Request-Id header to every response: the request's own, or a "
                        "random one (vLLM's flag)")
    # vLLM launch lines carry these; taken so that they run here unchanged
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine / SpecDecoding log lines (vLLM's; --log-stats-interval 0)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request: its id, prompt length and sampling parameters "
                        "(vLLM's flag)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag: requests are not logged unless --enable-log-requests")
    p.add_argument("--uvicorn-log-level", default=None,
                   choices=("debug", "info", "warning", "error", "critical", "trace"),
                   help="the HTTP server's own log level (default: --log-level's)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='vLLM\'s: {"backend": ..., "disable_any_whitespace": true|false}; one '
                        "backend serves every name (outlines-core); disable_any_whitespace is "
                        "the default of JSON constraints")
    p.add_argument("--guided-decoding-backend", default=None, choices=STRUCTURED_BACKENDS,
                   help="vLLM's older flag: taken, and outlines-core serves every name")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default when a request sends tools): the model '
                        "decides, and its tool calls are parsed out of its text by "
                        "--tool-call-parser (vLLM's flag)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help=f"the format of the model's tool calls for --enable-auto-tool-choice: "
                        f"{', '.join(TOOL_CALL_PARSERS)} (Hermes / Qwen <tool_call> blocks)")
    add_speculative_spelling_args(p)


#: vLLM's structured-output backend names: taken, and outlines-core serves every one
STRUCTURED_BACKENDS = ("auto", "outlines", "xgrammar", "guidance", "lm-format-enforcer")
#: ``--structured-outputs-config`` keys that change nothing here (vLLM's backend tuning)
_IGNORED_STRUCTURED_KEYS = ("disable_fallback", "disable_additional_properties", "reasoning_parser",
                            "enable_in_reasoning")


def structured_outputs_defaults(raw: str | None) -> dict[str, bool]:
    """``--structured-outputs-config`` (vLLM's JSON) -> the request defaults it sets
    (``{"disable_any_whitespace": True}`` or ``{}``); a ValueError
    naming the flag for JSON that is not an object, an unknown key or backend, or a non-bool."""
    if raw is None:
        return {}
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"--structured-outputs-config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError('--structured-outputs-config must be a JSON object, e.g. {"backend": "auto"}')
    known = ("backend", "disable_any_whitespace", *_IGNORED_STRUCTURED_KEYS)
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(f"--structured-outputs-config has unknown keys {unknown}; it takes "
                         f"{', '.join(known)}")
    if config.get("backend", "auto") not in STRUCTURED_BACKENDS:
        raise ValueError(f"--structured-outputs-config backend must be one of "
                         f"{', '.join(STRUCTURED_BACKENDS)}, got {config['backend']!r}")
    whitespace = config.get("disable_any_whitespace", False)
    if not isinstance(whitespace, bool):
        raise ValueError("--structured-outputs-config disable_any_whitespace must be true or false, "
                         f"got {whitespace!r}")
    return {"disable_any_whitespace": True} if whitespace else {}


def tool_call_settings(args: argparse.Namespace) -> dict:
    """``--enable-auto-tool-choice`` and ``--tool-call-parser`` as ServerConfig fields; a
    ValueError for an unknown parser, or auto tool choice without one."""
    enabled = bool(getattr(args, "enable_auto_tool_choice", False))
    parser = getattr(args, "tool_call_parser", None)
    check_tool_call_parser(enabled, parser)
    return {"enable_auto_tool_choice": enabled, "tool_call_parser": parser}


def add_speculative_spelling_args(p: argparse.ArgumentParser) -> None:
    """vLLM's and SGLang's spellings of ``--draft`` / ``--num-speculative-tokens`` (serve,
    generate, bench; merged by :func:`merge_speculative_spellings`)."""
    g = p.add_argument_group("speculative decoding, vLLM and SGLang spellings")
    g.add_argument("--speculative-config", default=None,
                   help='vLLM JSON: {"method": "dflash", "model": DIR, "num_speculative_tokens": K}')
    g.add_argument("--speculative-algorithm", default=None, help="SGLang: DFLASH")
    g.add_argument("--speculative-draft-model-path", default=None, help="SGLang: drafter directory")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="SGLang: verify width incl. the bonus token (K + 1)")
    g.add_argument("--speculative-dflash-block-size", type=int, default=None,
                   help="SGLang: DFlash block size (must equal --speculative-num-draft-tokens)")
    g.add_argument("--speculative-draft-model-quantization", default=None,
                   help="SGLang: fp8 (as --draft-quantization fp8), or unquant (the drafter in the "
                        "engine's dtype)")
    g.add_argument("--speculative-token-map", default=None, metavar="FILE",
                   help="SGLang: draft only among these token ids (a .pt of a 1-D tensor, or a "
                        ".json list; `laguna-dflash token-map` writes one): the drafter reads their "
                        "rows of the lm_head, not all of it (FR-Spec; drafts may change, the output "
                        "does not)")


def _agree(kind: str, candidates: list[tuple[str, object]]) -> tuple[str | None, object]:
    """The one value all flags give, or a ValueError naming two flags that disagree."""
    if not candidates:
        return None, None
    first_flag, first = candidates[0]
    for flag, value in candidates[1:]:
        if value != first:
            raise ValueError(
                f"conflicting {kind}: {first_flag} gives {first!r} but {flag} gives {value!r}; "
                "set it once (or make both flags agree)")
    return first_flag, first


def _vllm_json(text: str) -> object:
    """``--speculative-config``'s JSON, parsed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON ({e}); e.g. "
                         '\'{"method": "dflash", "model": DIR, "num_speculative_tokens": 15}\'') from e


def _vllm_spec(text: str) -> tuple[str, int | None, int | None]:
    """``--speculative-config`` JSON -> (drafter directory, K or None, its
    draft_tensor_parallel_size or None)."""
    return from_vllm_speculative_config(_vllm_json(text), "--speculative-config")


def _draft_block_size(draft: str) -> int | None:
    """The drafter's DFlash block size from its config.json (None if unreadable)."""
    try:
        cfg = json.loads((Path(draft) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = dflash_value(cfg, "block_size") if isinstance(cfg, dict) else None
    return int(value) if value else None


def generation_defaults(choice: str, model: str) -> dict[str, float]:
    """``--generation-config`` (generation_config.sampling_defaults): auto = ``model``'s
    ``generation_config.json``; vllm / none = no defaults; else a directory that must hold a
    ``generation_config.json``. Its ``max_new_tokens`` (key ``max_tokens``) caps every request's
    completion budget, as vLLM's server does (sampling.resolve_max_tokens); it must be an
    integer >= 1."""
    defaults = sampling_defaults(choice, model)
    cap = defaults.get("max_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        source = model if choice == "auto" else choice
        raise ValueError(f"{Path(source) / 'generation_config.json'}: max_new_tokens must be an "
                         f"integer >= 1, got {cap!r}; fix the file or pass --generation-config vllm")
    return defaults


def merge_speculative_spellings(args: argparse.Namespace) -> tuple[str | None, str | None,
                                                                  str | None, int | None]:
    """The drafter and K from ours, vLLM's and SGLang's spellings -> (the flag naming the
    drafter, its directory, the flag naming K, K); each None where none was given. Spellings may
    be mixed where they agree; a disagreement is an error naming both flags."""
    drafts: list[tuple[str, object]] = []
    tokens: list[tuple[str, object]] = []
    if getattr(args, "draft", None):
        drafts.append(("--draft", os.path.normpath(args.draft)))
    if getattr(args, "num_speculative_tokens", None) is not None:
        tokens.append(("--num-speculative-tokens", args.num_speculative_tokens))
    if getattr(args, "speculative_config", None):
        model, k, _ = _vllm_spec(args.speculative_config)
        drafts.append(("--speculative-config model", os.path.normpath(model)))
        if k is not None:
            tokens.append(("--speculative-config num_speculative_tokens", k))
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm is not None and algorithm.upper() != "DFLASH":
        raise ValueError(f"--speculative-algorithm {algorithm} is not supported; use DFLASH")
    if getattr(args, "speculative_draft_model_path", None):
        drafts.append(("--speculative-draft-model-path",
                       os.path.normpath(args.speculative_draft_model_path)))
    elif algorithm is not None:
        raise ValueError("--speculative-algorithm DFLASH requires --speculative-draft-model-path DIR")
    for flag in ("--speculative-num-draft-tokens", "--speculative-dflash-block-size"):
        width = getattr(args, flag[2:].replace("-", "_"), None)
        if width is None:
            continue
        if width < 2:
            raise ValueError(f"{flag} is the verify width incl. the bonus token; it must be >= 2, "
                             f"got {width}")
        tokens.append((f"{flag} (minus the bonus token)", width - 1))
    draft_flag, draft = _agree("draft models", drafts)
    tokens_flag, k = _agree("numbers of speculative tokens", tokens)
    return draft_flag, draft, tokens_flag, k


def merge_draft_tensor_parallel_size(args: argparse.Namespace) -> int | None:
    """``--draft-tensor-parallel-size`` and ``--speculative-config``'s
    ``draft_tensor_parallel_size`` (None where neither gives it; an error where they disagree)."""
    sizes: list[tuple[str, object]] = []
    if getattr(args, "draft_tensor_parallel_size", None) is not None:
        sizes.append(("--draft-tensor-parallel-size", args.draft_tensor_parallel_size))
    if getattr(args, "speculative_config", None):
        size = _vllm_spec(args.speculative_config)[2]
        if size is not None:
            sizes.append(("--speculative-config draft_tensor_parallel_size", size))
    return _agree("drafter tensor-parallel sizes", sizes)[1]


def merge_draft_quantization(args: argparse.Namespace) -> str | None:
    """``--draft-quantization``, SGLang's ``--speculative-draft-model-quantization`` (``unquant``:
    none) and ``--speculative-config``'s ``quantization`` -> "fp8" or None (an error where they
    disagree or name another method)."""
    choices: list[tuple[str, object]] = []
    if getattr(args, "draft_quantization", None) is not None:
        choices.append(("--draft-quantization", args.draft_quantization))
    sglang = getattr(args, "speculative_draft_model_quantization", None)
    if sglang is not None:
        if sglang not in (*DRAFT_QUANTIZATIONS, "unquant"):
            raise ValueError(f"--speculative-draft-model-quantization {sglang} is not supported for the "
                             "drafter; use fp8 (weight-only, models/fp8.py) or unquant")
        choices.append(("--speculative-draft-model-quantization", None if sglang == "unquant" else sglang))
    if getattr(args, "speculative_config", None):
        cfg = _vllm_json(args.speculative_config)
        if isinstance(cfg, dict) and "quantization" in cfg:
            choices.append(("--speculative-config quantization",
                            vllm_draft_quantization(cfg, "--speculative-config")))
    return _agree("drafter quantizations", choices)[1]


def merge_k_schedule(args: argparse.Namespace) -> tuple[tuple[int, int, int], ...] | None:
    """``--speculative-config``'s ``num_speculative_tokens_per_batch_size`` (vLLM's K schedule
    by batch size; config.k_schedule checks it), or None."""
    cfg = _vllm_json(args.speculative_config) if getattr(args, "speculative_config", None) else None
    return vllm_k_schedule(cfg, "--speculative-config") if isinstance(cfg, dict) else None


def resolve_speculative(args: argparse.Namespace) -> SpeculativeChoice:
    """Merge the three speculative spellings into one :class:`SpeculativeChoice`."""
    draft_flag, draft, tokens_flag, k = merge_speculative_spellings(args)
    schedule = merge_k_schedule(args)
    if draft is None:
        needs_drafter = [tokens_flag.split(" ")[0]] if tokens_flag is not None else []
        needs_drafter += [flag for flag, is_given in (
            ("--adaptive-k", getattr(args, "adaptive_k", False)),
            ("--draft-quantization", merge_draft_quantization(args) is not None),
            ("--speculative-token-map", getattr(args, "speculative_token_map", None) is not None),
            ("--simulate-acceptance-length", getattr(args, "simulate_acceptance_length", None) is not None),
            ("--draft-tensor-parallel-size", merge_draft_tensor_parallel_size(args) is not None))
            if is_given]
        if needs_drafter:  # they act on draft tokens: without a drafter they would do nothing
            raise ValueError(f"{needs_drafter[0]} needs a drafter: pass --draft DIR "
                             "(or --speculative-config / --speculative-draft-model-path)")
        return SpeculativeChoice(None)
    if getattr(args, "no_spec", False):
        logger.warning("--no-spec: ignoring the drafter given by %s", draft_flag)
        return SpeculativeChoice(None)
    return SpeculativeChoice(SpeculativeConfig(draft=str(draft), num_speculative_tokens=k,
                                               adaptive=bool(getattr(args, "adaptive_k", False)),
                                               num_speculative_tokens_per_batch_size=schedule,
                                               simulate_acceptance_length=getattr(
                                                   args, "simulate_acceptance_length", None),
                                               draft_tensor_parallel_size=merge_draft_tensor_parallel_size(args),
                                               draft_quantization=merge_draft_quantization(args),
                                               speculative_token_map=getattr(args, "speculative_token_map", None)),
                             draft_flag=draft_flag, tokens_flag=tokens_flag,
                             block_size=_draft_block_size(str(draft)))


def merge_model_spellings(args: argparse.Namespace) -> None:
    """``serve MODEL`` (vLLM's positional form) and ``--model MODEL`` into ``args.model``: one
    of them, or both naming the same directory; a ``ValueError`` otherwise."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and os.path.normpath(tag) != os.path.normpath(args.model):
        raise ValueError(f"give the model once: serve {tag} and --model {args.model} disagree")
    args.model = args.model if args.model is not None else tag
    if args.model is None:
        raise ValueError("serve needs the target model: laguna-dflash serve MODEL_DIR (or --model "
                         "MODEL_DIR)")


def resolve_server_config(args: argparse.Namespace) -> ServerConfig:
    """Resolve every derived setting from parsed ``serve`` flags and log the result once."""
    merge_model_spellings(args)
    spec = resolve_speculative(args)
    engine = EngineConfig(
        model=str(args.model), dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, speculative=spec.config,
        scheduling_policy=getattr(args, "scheduling_policy", EngineConfig.scheduling_policy),
        seed=args.seed,
        attention_backend=getattr(args, "attention_backend", EngineConfig.attention_backend),
        enforce_eager=getattr(args, "enforce_eager", False),
        cuda_graph_capture=getattr(args, "cuda_graph_capture", EngineConfig.cuda_graph_capture),
        cuda_graph_max_bs=getattr(args, "cuda_graph_max_bs", EngineConfig.cuda_graph_max_bs),
        mem_fraction_static=getattr(args, "mem_fraction_static", EngineConfig.mem_fraction_static),
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization",
                                       EngineConfig.gpu_memory_utilization),
        load_format=getattr(args, "load_format", EngineConfig.load_format),
        batch_invariant=bool(getattr(args, "batch_invariant", False)),
        tensor_parallel_size=int(getattr(args, "tensor_parallel_size", 1)),
        enable_expert_parallel=bool(getattr(args, "enable_expert_parallel", False)),
        enable_prefix_caching=bool(getattr(args, "enable_prefix_caching",
                                           EngineConfig.enable_prefix_caching)),
        enable_chunked_prefill=bool(getattr(args, "enable_chunked_prefill",
                                            EngineConfig.enable_chunked_prefill)),
        disable_hybrid_kv_cache_manager=bool(getattr(args, "disable_hybrid_kv_cache_manager", False)),
        max_prefill_graph_tokens=int(getattr(args, "max_prefill_graph_tokens",
                                             EngineConfig.max_prefill_graph_tokens)),
        max_logprobs=int(getattr(args, "max_logprobs", EngineConfig.max_logprobs)),
    )
    chat_template = read_chat_template(getattr(args, "chat_template", None))
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    defaults = generation_defaults(args.generation_config, args.model)
    config = ServerConfig(
        engine=engine, host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None,
        served_model_name=(args.served_model_name or [str(args.model)])[0],
        served_model_aliases=tuple(dict.fromkeys((args.served_model_name or [])[1:])),
        tokenizer=args.tokenizer or str(args.model), generation_defaults=defaults,
        log_stats_interval_s=(0.0 if getattr(args, "disable_log_stats", False)
                              else max(0.0, float(args.log_stats_interval))),
        uvicorn_log_level=str(getattr(args, "uvicorn_log_level", None) or args.log_level).lower(),
        speculative=spec,
        chat_template=chat_template,
        trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
        enable_request_id_headers=bool(getattr(args, "enable_request_id_headers", False)),
        log_requests=bool(getattr(args, "enable_log_requests", False)),
        structured_outputs_defaults=structured_outputs_defaults(getattr(args, "structured_outputs_config", None)),
        **tool_call_settings(args),
    )
    logger.info("resolved serve configuration: %s",
                ", ".join(f"{k}={v}" for k, v in config.describe().items()))
    return config
