"""Command line: ``laguna-dflash generate | serve | bench | train-target | train-draft | token-map``.

Also ``python -m laguna_dflash ...``. ``generate`` and ``bench`` without ``--model`` use the
embedded demo pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
import typing
from pathlib import Path

import torch

from .config import DRAFT_QUANTIZATIONS, EngineConfig, SamplingParams
from .config import flag as config_flag
from .distributed import is_rank_zero
from .structured_outputs import StructuredOutputsParams

if typing.TYPE_CHECKING:
    from .llm import LLM, RequestOutput

logger = logging.getLogger("laguna_dflash")


class _Parser(argparse.ArgumentParser):
    """Usage errors are one readable line and exit code 2 (``--help`` still prints usage)."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


#: ``--log-level`` values (any case), as the ``logging`` module names them.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers like 1,2,3 (got {text!r})"
        ) from e


def _parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"regex\": \"[0-9]+\"}}' "
                                         f"(got {text!r:.80}: {e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"choice\": [\"yes\", "
                                         f"\"no\"]}}' (got {text!r:.80})")
    return value


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = True,
                    model_default: str = "the embedded demo pair") -> None:
    p.add_argument("--model", required=model_required,
                   help="target checkpoint directory (HF layout)"
                   + ("" if model_required else f"; default: {model_default}"))
    p.add_argument("--draft", help="DFlash drafter checkpoint directory (enables speculation)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="taken for vLLM / SGLang launch lines; changes nothing: the Laguna and "
                        "Qwen3 targets and the DFlash drafters are built in, and no code from a "
                        "checkpoint is ever run")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step K (default: the drafter's block_size - 1)")
    p.add_argument("--no-spec", action="store_true", help="ignore --draft: target-only decoding")
    p.add_argument("--simulate-acceptance-length", type=float, default=None,
                   help="benchmarking only: accept drafts blindly at this mean acceptance length "
                        "(output is not the target's)")
    p.add_argument("--adaptive-k", action="store_true",
                   help="pick the draft length per step (<= K, 0 = no drafting) from measured "
                        "acceptance and step cost")
    p.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default=None,
                   help="fp8: the drafter's MLP gate|up and lm_head copy as fp8 rows with scales "
                        "(half their bytes in launches of up to 16 rows, e.g. batch <= 4 at K = 3; "
                        "drafts may change, the output does not)")
    # vLLM's default: a bf16 checkpoint runs in bf16 on a GPU (float32 there would double the
    # weights' memory and bytes a step), and in float32 on the CPU, as before
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default auto: "
                        "float32 on the CPU, the checkpoint's torch_dtype, else bfloat16, on a GPU)")
    p.add_argument("--device", default=EngineConfig.device, help="cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence, prompt plus output, in tokens (default: the "
                        "model's max_position_embeddings, at most 8192)")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="KV block size")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks of --block-size tokens (default: room for every "
                        "request decoded together at full length, within the memory budget on "
                        "a GPU)")
    p.add_argument("--attention-backend", default=EngineConfig.attention_backend,
                   help="auto (paged Triton kernels on a GPU, torch SDPA elsewhere) | torch_sdpa | triton")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode-phase forwards eagerly instead of replaying CUDA graphs (GPU)")
    p.add_argument("--cuda-graph-capture", default=EngineConfig.cuda_graph_capture,
                   choices=("startup", "lazy"),
                   help="startup: capture the decode-phase CUDA graphs of every batch size and "
                        "key-length bucket before serving, so no step waits for a capture; lazy: "
                        "capture each the first time it is needed (faster start, first-use stalls)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=EngineConfig.cuda_graph_max_bs,
                   help="the largest batch (requests) whose decode-phase forwards replay CUDA "
                        "graphs; larger batches run eagerly. Fewer graphs to capture: a faster "
                        "start and less graph memory (default: --max-num-seqs, at most 256; "
                        "SGLang's flag)")
    p.add_argument("--mem-fraction-static", type=float, default=EngineConfig.mem_fraction_static,
                   help="GPU: the fraction of the device's memory for the weights and the KV "
                        "cache together, the rest left for activations, CUDA graphs and other "
                        "processes (SGLang's flag; default: the KV cache takes 80%% of the memory "
                        "free after loading; --num-kv-blocks overrides both)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=EngineConfig.gpu_memory_utilization,
                   help="GPU: the fraction of the device's memory for the weights, the "
                        "activations of the largest step (profiled at start-up) and the KV cache "
                        "together (vLLM's flag, e.g. 0.9; CUDA graph memory not counted). Set it "
                        "or --mem-fraction-static, not both")
    p.add_argument("--load-format", default=EngineConfig.load_format, choices=("auto", "dummy"),
                   help="auto: read the checkpoint's weights; dummy: read only config.json (and the "
                        "tokenizer) and fill the weights with seeded random values at real shapes, "
                        "on the device (benchmarking without weights, as vLLM's --load-format dummy)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run the target with batch-invariant kernels: a prompt's greedy tokens are "
                        "the same in any batch and with or without speculation, in bf16 too "
                        "(slower; needs a CUDA GPU; as vLLM's VLLM_BATCH_INVARIANT=1)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=EngineConfig.tensor_parallel_size,
                   help="shard the target over this many ranks (launch one process per rank: "
                        "torchrun --nproc-per-node N -m laguna_dflash ...)")
    p.add_argument("--draft-tensor-parallel-size", type=int, default=None,
                   help="with --tensor-parallel-size N and a drafter: 1 replicates the drafter on "
                        "every rank, N shards its layers as the target's (then its context K/V "
                        "can share the target's KV pool); default: N where the drafter's heads "
                        "and MLP width divide it, else 1 (vLLM's speculative-config key)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.enable_prefix_caching,
                   help="keep full KV blocks after their request, keyed by their token prefix, so "
                        "a prompt that starts like an earlier one prefills only the rest (vLLM's "
                        "automatic prefix caching; on by default)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.enable_chunked_prefill,
                   help="compute a prompt longer than --max-num-batched-tokens in chunks over "
                        "several steps, alternating with decode steps (vLLM's chunked prefill; "
                        "on by default)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's K/V at every position (vLLM's flag): by default a "
                        "target with full and sliding-window layers (Laguna) keeps the sliding "
                        "layers' K/V only within their window, about 4x the tokens a GiB holds")
    p.add_argument("--max-prefill-graph-tokens", type=int, default=EngineConfig.max_prefill_graph_tokens,
                   help="replay prefill steps of up to 4 requests from CUDA graphs when their "
                        "requests, padded to the longest one's power-of-two bucket, hold at most "
                        "this many tokens (short prefills are otherwise host-bound); 0: every "
                        "prefill eager")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size N: each rank holds 1/N of the routed experts, "
                        "whole, instead of 1/N of every expert's width (attention, dense MLPs and "
                        "the shared expert stay tensor-parallel; vLLM's flag)")
    p.add_argument("--max-logprobs", type=int, default=EngineConfig.max_logprobs,
                   help="the most logprobs / prompt logprobs a request may ask for (-1: the whole "
                        "vocabulary; vLLM's flag)")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="logging level (default: WARNING; INFO for serve)")


def engine_options(args: argparse.Namespace) -> dict:
    """The shared engine flags (:func:`add_engine_args`) as ``LLM`` keyword arguments."""
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                cuda_graph_capture=args.cuda_graph_capture, cuda_graph_max_bs=args.cuda_graph_max_bs,
                mem_fraction_static=args.mem_fraction_static,
                gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format,
                batch_invariant=args.batch_invariant,
                tensor_parallel_size=args.tensor_parallel_size,
                enable_expert_parallel=args.enable_expert_parallel,
                enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill,
                disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                max_prefill_graph_tokens=args.max_prefill_graph_tokens,
                max_logprobs=args.max_logprobs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="laguna-dflash", description=__doc__)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"laguna-dflash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from .server.args import add_server_args, add_speculative_spelling_args

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(g, model_required=False)
    add_speculative_spelling_args(g)
    g.add_argument("text", nargs="?", help="prompt text (same as --prompt)")
    g.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    g.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", "--max-tokens", type=int, default=64,
                   help="tokens to generate (--max-tokens: the OpenAI / vLLM spelling)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches P (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest tokens (0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit once per time it was generated (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="the request's sampling seed: the same seed gives the same tokens")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, to --max-new-tokens")
    g.add_argument("--structured-outputs", type=_parse_json_object, default=None, metavar="JSON",
                   help="constrain the output as vLLM's structured_outputs, a JSON object of one "
                        'constraint: {"regex": ...}, {"choice": [...]}, {"json": SCHEMA}, '
                        '{"json_object": true} or {"grammar": LARK_OR_GBNF} (needs a tokenizer and '
                        "laguna-dflash[structured])")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--trace", action="store_true",
                   help="with --json: per step anchor position, draft tokens, accepted count")
    g.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="also run target-only and report both speeds (default: on for the demo pair)")
    g.add_argument("--compare-rounds", type=int, default=None, metavar="N",
                   help="with --compare: run DFlash and target-only N times each, alternating, and "
                        "report each one's best decode speed (default 3; 1: one run each)")
    b = sub.add_parser("bench", help="tokens/s with and without speculation on a prompt set")
    add_engine_args(b, model_required=False)
    add_speculative_spelling_args(b)
    b.add_argument("--prompts", help="JSON list / JSON Lines of prompts: strings, {\"prompt\": ...} or "
                                     "{\"prompt_token_ids\": [...]} (for a model without a "
                                     "tokenizer) (default: held-out set)")
    b.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N prompts (default: all of them)")
    b.add_argument("--max-new-tokens", "--max-tokens", type=int, default=128,
                   help="tokens to generate per prompt (--max-tokens: the same)")
    b.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    b.add_argument("--plot", help="save the per-position acceptance plot to this PNG (needs "
                                  "matplotlib)")
    b.add_argument("--json", action="store_true", help="print the result as one JSON object")
    from .train.draft import DraftTrainConfig
    from .train.target import TargetTrainConfig

    add_dataclass_args(sub.add_parser("train-target", help="pretrain a small Laguna MoE on Python source"),
                       TargetTrainConfig)
    add_dataclass_args(sub.add_parser("train-draft", help="distil a DFlash drafter for a target"),
                       DraftTrainConfig)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the target checkpoint directory, as vLLM's `vllm serve MODEL` (or --model)")
    add_engine_args(s, model_required=False, model_default="the positional MODEL")
    add_server_args(s)
    s.set_defaults(log_level="INFO")
    t = sub.add_parser("token-map", help="count a corpus and write the token map of its most "
                                         "frequent tokens (for --speculative-token-map)")
    t.add_argument("--model", required=True,
                   help="target checkpoint directory: its tokenizer counts the corpus, its "
                        "config.json gives the vocabulary size and the end-of-sequence ids (always kept)")
    t.add_argument("--data", required=True, nargs="+", metavar="PATH",
                   help="corpus files or directories: .jsonl / .json records (a string, or an object "
                        "with \"text\", \"prompt\"+\"completion\" or \"messages\"), other files as "
                        "UTF-8 text; a directory: every file under it matching --glob")
    t.add_argument("--glob", default="*",
                   help="in --data directories, read the files (recursively) whose names match this "
                        "pattern, e.g. '*.jsonl' (default: every file)")
    t.add_argument("--num-tokens", required=True, type=int, metavar="N",
                   help="token ids in the map, 1 to the vocabulary size (FR-Spec: 32k of Llama-3's 128k)")
    t.add_argument("--output", required=True, metavar="FILE",
                   help="the token map to write: .pt (torch.save of the ids, SGLang's format) or .json")
    t.add_argument("--max-bytes", type=int, default=None, metavar="N",
                   help="stop reading after this many characters of text in all (default: the whole corpus)")
    t.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    t.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="logging level (default: WARNING)")
    return parser


def add_dataclass_args(p: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per dataclass field, defaults taken from the dataclass (defined once)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = config_flag(f.name)
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        required = f.default is dataclasses.MISSING
        default = None if required else f.default
        text = f.metadata.get("help", "")
        if required:
            text += " (required)"
        elif "default:" not in text:  # a field whose text explains its default says it itself
            text += f" (default: {'unset' if default is None else default})"
        if base is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=text)
            continue
        p.add_argument(flag, dest=f.name, type=base, required=required, default=default, help=text)
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="logging level (default: INFO)")
    p.set_defaults(config_class=cls)


#: ``generate``'s sampling flags and the :class:`SamplingParams` field each one sets.
GENERATE_SAMPLING_FLAGS = {
    "--temperature": "temperature", "--top-p": "top_p", "--top-k": "top_k",
    "--max-new-tokens": "max_tokens", "--seed": "seed", "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty", "--repetition-penalty": "repetition_penalty",
}


def sampling_params_from_flags(args: argparse.Namespace) -> SamplingParams:
    """``generate``'s :class:`SamplingParams`; a bad value is an error naming its flag (the
    dataclass alone would name its field: ``--max-new-tokens 0`` is ``max_tokens`` there)."""
    values = {field: getattr(args, flag[2:].replace("-", "_"))
              for flag, field in GENERATE_SAMPLING_FLAGS.items()}
    for flag, field in GENERATE_SAMPLING_FLAGS.items():  # each field is checked on its own
        try:
            SamplingParams(**{field: values[field]})
        except ValueError as e:
            raise ValueError(f"{flag} {values[field]}: {e}") from e
    try:
        structured = StructuredOutputsParams.of(args.structured_outputs)
    except ValueError as e:
        raise ValueError(f"--structured-outputs: {e}") from e
    return SamplingParams(**values, ignore_eos=args.ignore_eos, structured_outputs=structured)


def check_checkpoint_dir(flag: str, path: str | None, what: str) -> None:
    """A checkpoint flag's directory exists, or an error naming the flag (the loader's own
    message says "model path" whichever flag gave it)."""
    if path is not None and not Path(path).is_dir():
        raise ValueError(f"{flag} {path}: no such directory; pass {what} (a local Hugging Face "
                         "checkpoint directory with config.json and *.safetensors)")


def check_plot_path(path: str) -> None:
    """``bench --plot PNG`` can be written: checked before the benchmark runs, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--plot needs matplotlib: pip install 'laguna-dflash[plot]' (or "
                         f"matplotlib), or drop --plot ({e})") from e
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ValueError(f"--plot {path}: directory {parent} does not exist; create it or pick "
                         "another path")


def resolve_pair(args: argparse.Namespace) -> tuple[str, str | None, bool]:
    """(model, draft, is_demo): the embedded pair when no --model is given. serve's vLLM and
    SGLang spellings of the drafter and K are merged into ``args.draft`` and
    ``args.num_speculative_tokens`` first."""
    from .server.args import (
        merge_draft_quantization,
        merge_draft_tensor_parallel_size,
        merge_k_schedule,
        merge_speculative_spellings,
    )

    draft_flag, args.draft, _, args.num_speculative_tokens = merge_speculative_spellings(args)
    args.num_speculative_tokens_per_batch_size = merge_k_schedule(args)
    args.draft_tensor_parallel_size = merge_draft_tensor_parallel_size(args)
    args.draft_quantization = merge_draft_quantization(args)
    check_checkpoint_dir("--model", args.model, "the target model's directory")
    if not args.no_spec:
        check_checkpoint_dir(draft_flag or "--draft", args.draft, "the DFlash drafter's directory")
    if args.model is not None:
        return args.model, (None if args.no_spec else args.draft), False
    from .demo import demo_pair

    target, draft = demo_pair()
    if args.draft is not None:
        draft = args.draft
    return target, (None if args.no_spec else draft), True


# generate --compare: runs of each engine, alternating (--compare-rounds)
DEFAULT_COMPARE_ROUNDS = 3


def _request_tokens_per_s(llm: LLM, prompt: str | None, prompt_ids: list[int] | None,
                          params: SamplingParams) -> tuple[RequestOutput, float]:
    """One request on ``llm`` -> (its output, decode tokens/s: its tokens over the decode time
    this run added to the engine's counters; 0.0 when it decoded nothing)."""
    from .bench import timed_generate

    request = {"prompts": [prompt]} if prompt is not None else {"prompt_token_ids": [prompt_ids]}
    outs, decode_s = timed_generate(llm, **request, sampling_params=params)
    return outs[0], (len(outs[0].token_ids) / decode_s if decode_s > 0 else 0.0)


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM

    model, draft, is_demo = resolve_pair(args)
    compare = is_demo if args.compare is None else args.compare
    if args.prompt is not None and args.text is not None:  # one of them would be dropped
        raise ValueError("give the prompt once: as TEXT or as --prompt, not both")
    prompt = args.prompt if args.prompt is not None else args.text
    if (prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of a prompt (TEXT or --prompt) or --prompt-ids")
    params = sampling_params_from_flags(args)
    for flag, is_given in (("--num-speculative-tokens", args.num_speculative_tokens is not None),
                           ("--adaptive-k", args.adaptive_k),
                           ("--draft-quantization", args.draft_quantization is not None),
                           ("--speculative-token-map", args.speculative_token_map is not None),
                           ("--simulate-acceptance-length", args.simulate_acceptance_length is not None),
                           ("--draft-tensor-parallel-size", args.draft_tensor_parallel_size is not None),
                           ("--speculative-config num_speculative_tokens_per_batch_size",
                            args.num_speculative_tokens_per_batch_size is not None),
                           ("--compare", args.compare is True)):
        if is_given and draft is None:  # they act on draft tokens: without a drafter, nothing
            raise ValueError(f"{flag} needs --draft DIR (and no --no-spec)")
    if args.trace and not args.json:
        raise ValueError("--trace adds the per-step trace to the --json output; add --json")
    if args.compare_rounds is not None:
        if args.compare_rounds < 1:
            raise ValueError(f"--compare-rounds must be at least 1, got {args.compare_rounds}")
        if not compare or draft is None:
            raise ValueError("--compare-rounds times DFlash against target-only: it needs --compare and a "
                             "drafter (--draft DIR)")
    num_rounds = args.compare_rounds or DEFAULT_COMPARE_ROUNDS
    t0 = time.perf_counter()
    # one request: batch-1 KV sizing and CUDA graphs (start-up capture of batch size 1 only)
    llm = LLM(model=model, draft=draft, **engine_options(args), max_num_seqs=1,
              num_speculative_tokens=args.num_speculative_tokens,
              adaptive_k=args.adaptive_k, simulate_acceptance_length=args.simulate_acceptance_length,
              num_speculative_tokens_per_batch_size=args.num_speculative_tokens_per_batch_size,
              draft_tensor_parallel_size=args.draft_tensor_parallel_size,
              draft_quantization=args.draft_quantization,
              speculative_token_map=args.speculative_token_map, trace=args.trace)
    load_s = time.perf_counter() - t0
    run = functools.partial(_request_tokens_per_s, prompt=prompt, prompt_ids=args.prompt_ids, params=params)
    out, decode_tps = run(llm)
    m = llm.get_metrics()  # the first run's: the reported output and acceptance are its
    timings = {"load_s": load_s, "prefill_s": m["prefill_s"], "decode_s": m["decode_s"],
               "decode_tokens_per_s": decode_tps}
    if compare and draft is not None:  # on every rank: a sharded engine needs all of them
        # rounds alternate the two engines, so a slow spell of a shared machine hits both; each
        # engine's best round is reported (a round's speed: its tokens over its decode time)
        base = LLM(model=model, **engine_options(args), max_num_seqs=1)
        # every round's tokens, both engines': each must equal the first DFlash run's
        round_ids, spec_tps, base_tps = [], [decode_tps], []
        for i in range(num_rounds):
            if i:
                spec_out, tps = run(llm)
                round_ids.append(spec_out.token_ids)
                spec_tps.append(tps)
            base_out, tps = run(base)
            round_ids.append(base_out.token_ids)
            base_tps.append(tps)
        timings.update(compare_rounds=num_rounds, decode_tokens_per_s=max(spec_tps),
                       decode_tokens_per_s_per_round=spec_tps, target_only_decode_tokens_per_s=max(base_tps),
                       target_only_decode_tokens_per_s_per_round=base_tps)
        timings["speedup"] = timings["decode_tokens_per_s"] / max(timings["target_only_decode_tokens_per_s"], 1e-9)
        timings["outputs_identical"] = all(ids == out.token_ids for ids in round_ids)
    if not is_rank_zero():  # every rank ran the same generation; rank 0 reports it
        return 0
    if args.json:
        obj = {"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
               "timings": timings}
        if draft is not None:
            obj.update({k: v for k, v in out.metrics.items() if k != "trace"})
            if args.trace:
                obj["trace"] = out.metrics.get("trace", [])
        print(json.dumps(obj))
        return 0
    shown = out.text if out.text is not None else " ".join(map(str, out.token_ids))
    print(((prompt or "") if is_demo else "") + shown)
    stats = f"[{len(out.token_ids)} tokens, finish={out.finish_reason}"
    if draft is not None:
        stats += f", mean acceptance length {out.metrics['mean_acceptance_length']:.2f}"
    stats += f", {timings['decode_tokens_per_s']:.1f} tok/s" + (" with DFlash" if draft is not None else "")
    if "target_only_decode_tokens_per_s" in timings:
        stats += (f", {timings['target_only_decode_tokens_per_s']:.1f} tok/s target-only, "
                  f"speedup {timings['speedup']:.2f}x")
        if num_rounds > 1:
            stats += f" (best of {num_rounds} alternating runs each)"
        if args.temperature == 0:  # greedy: speculation must not change a token (sampled runs may)
            if timings["outputs_identical"]:
                stats += ", same tokens as target-only"
            elif llm.engine.dtype == torch.float32 or args.batch_invariant:
                stats += ", TOKENS DIFFER from target-only"  # exact there: an alarm
            else:  # matmuls of other shapes round differently in half precision (README)
                name = str(llm.engine.dtype).removeprefix("torch.")
                stats += (f", tokens differ from target-only ({name} rounds differently "
                          "per batch shape; exact in float32 or with --batch-invariant)")
    print(stats + "]", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import format_result, load_prompts, run_bench, save_acceptance_plot

    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--max-new-tokens", args.max_new_tokens, 2)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}"
                             + (" (the first token comes from the prefill; decoding is timed)"
                                if flag == "--max-new-tokens" else ""))
    if args.plot:
        check_plot_path(args.plot)
    model, draft, _ = resolve_pair(args)
    if draft is None:
        raise ValueError("bench compares with and without speculation: it needs a drafter (--draft DIR)")
    if args.prompts:
        if not os.path.isfile(args.prompts):
            raise ValueError(f"--prompts {args.prompts}: no such file; pass a JSON list or JSON Lines "
                             "file of prompts")
        prompts = load_prompts(args.prompts)
    else:
        from .demo import heldout_prompts

        prompts = heldout_prompts()
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    result = run_bench(model, draft, prompts, args.max_new_tokens, args.batch_size,
                       args.num_speculative_tokens, args.adaptive_k,
                       draft_tensor_parallel_size=args.draft_tensor_parallel_size,
                       draft_quantization=args.draft_quantization,
                       speculative_token_map=args.speculative_token_map,
                       simulate_acceptance_length=args.simulate_acceptance_length,
                       num_speculative_tokens_per_batch_size=args.num_speculative_tokens_per_batch_size,
                       **engine_options(args))
    if not is_rank_zero():
        return 0
    # the numbers first: a plot that fails to save must not lose a finished benchmark
    print(json.dumps(result.as_dict()) if args.json else format_result(result), flush=True)
    if args.plot:
        save_acceptance_plot(result, args.plot)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    cls = args.config_class
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    config = cls(**values)
    if args.command == "train-target":
        from .train.target import train_target

        out = train_target(config)
    else:
        from .train.draft import train_draft

        out = train_draft(config)
    if is_rank_zero():  # data-parallel train-draft: rank 0 alone writes
        print(f"wrote {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``laguna-dflash serve``: resolve the flags (logged once), load, serve until interrupted."""
    from .server.args import resolve_server_config

    config = resolve_server_config(args)
    check_checkpoint_dir("--model", config.engine.model, "the target model's directory")
    spec = config.speculative
    if spec.config is not None:
        check_checkpoint_dir(spec.draft_flag or "--draft", spec.config.draft,
                             "the DFlash drafter's directory")
    if args.tokenizer is not None:  # given on purpose: one that loads nothing is an error
        from .llm import has_tokenizer

        if not has_tokenizer(args.tokenizer):
            raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json or "
                             "tokenizer_config.json there; pass a local tokenizer directory, or "
                             "leave --tokenizer unset to use --model's")
    try:
        from .server.launcher import serve
    except ImportError as e:
        raise RuntimeError(f"serve needs the server extras: pip install 'laguna-dflash[serve]' ({e})") from e
    return serve(config)


def cmd_token_map(args: argparse.Namespace) -> int:
    """``laguna-dflash token-map``: count the corpus, write the map, print the summary."""
    from .token_map import build_token_map

    summary = build_token_map(args.model, args.data, args.num_tokens, args.output, glob=args.glob,
                              max_bytes=args.max_bytes)
    if is_rank_zero():
        print(json.dumps(summary.as_dict()) if args.json else summary.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command in ("train-target", "train-draft"):
            return cmd_train(args)
        if args.command == "token-map":
            return cmd_token_map(args)
    except (ValueError, RuntimeError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
