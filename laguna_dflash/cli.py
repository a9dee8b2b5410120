"""Command line: ``laguna-dflash generate ...`` (also ``python -m laguna_dflash generate``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .config import EngineConfig, SamplingParams

logger = logging.getLogger("laguna_dflash")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers like 1,2,3 (got {text!r})"
        ) from e


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target checkpoint directory (HF layout)")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory (enables speculation)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step K (default: the drafter's block_size - 1)")
    p.add_argument("--no-spec", action="store_true", help="ignore --draft: target-only decoding")
    p.add_argument("--dtype", default=EngineConfig.dtype, help="float32 | bfloat16 | float16")
    p.add_argument("--device", default=EngineConfig.device, help="cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="KV block size")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--log-level", default="WARNING")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laguna-dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(g)
    g.add_argument("text", nargs="?", help="prompt text (same as --prompt)")
    g.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    g.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--trace", action="store_true",
                   help="with --json: per step anchor position, draft tokens, accepted count")
    from .server.args import add_server_args

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(s)
    add_server_args(s)
    s.set_defaults(log_level="INFO")
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM

    prompt = args.prompt if args.prompt is not None else args.text
    if (prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of a prompt (TEXT or --prompt) or --prompt-ids")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    draft = None if args.no_spec else args.draft
    if args.num_speculative_tokens is not None and draft is None:
        raise ValueError("--num-speculative-tokens needs --draft DIR (and no --no-spec)")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, draft=draft, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, num_speculative_tokens=args.num_speculative_tokens,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, trace=args.trace)
    load_s = time.perf_counter() - t0
    if prompt is not None:
        out = llm.generate(prompts=[prompt], sampling_params=params)[0]
    else:
        out = llm.generate(prompt_token_ids=[args.prompt_ids], sampling_params=params)[0]
    m = llm.get_metrics()
    decode_tps = len(out.token_ids) / m["decode_s"] if m["decode_s"] > 0 else 0.0
    timings = {"load_s": load_s, "prefill_s": m["prefill_s"], "decode_s": m["decode_s"],
               "decode_tokens_per_s": decode_tps}
    if args.json:
        obj = {"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
               "timings": timings}
        if draft is not None:
            obj.update({k: v for k, v in out.metrics.items() if k != "trace"})
            if args.trace:
                obj["trace"] = out.metrics.get("trace", [])
        print(json.dumps(obj))
        return 0
    print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    stats = f"[{len(out.token_ids)} tokens, {decode_tps:.1f} tok/s decode, finish={out.finish_reason}"
    if draft is not None:
        stats += f", mean acceptance length {out.metrics['mean_acceptance_length']:.2f}"
    print(stats + "]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``laguna-dflash serve``: resolve the flags (logged once), load, serve until interrupted."""
    from .server.args import resolve_server_config

    config = resolve_server_config(args)
    try:
        from .server.launcher import serve
    except ImportError as e:
        raise RuntimeError(f"serve needs the server extras: pip install 'laguna-dflash[serve]' ({e})") from e
    return serve(config)


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
    except (ValueError, RuntimeError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
