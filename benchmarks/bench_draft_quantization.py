"""What ``--draft-quantization fp8`` does to draft quality: the mean acceptance length of a
drafter as loaded and in fp8 (greedy), per dtype and K, and how many outputs equal
target-only's (float32: all must; bfloat16 rounds by batch shape). By default the embedded demo
pair on its held-out prompts, on the CPU (the fp8 weights are dequantized for ``F.linear``
there: the same values the GPU kernel multiplies); ``--model`` / ``--draft`` / ``--prompts``
run the same A/B on a real pair, e.g. Laguna-XS-2.1 and its DFlash drafter on one GPU. Prints a
short table::

    python benchmarks/bench_draft_quantization.py                      # float32 / bfloat16, K 3 / 7
    python benchmarks/bench_draft_quantization.py --dtypes float32 --ks 3 --max-tokens 64
    python benchmarks/bench_draft_quantization.py --model TARGET_DIR --draft DRAFT_DIR \
        --prompts prompts.jsonl --num-prompts 64 --device cuda --dtypes bfloat16 --ks 7
"""

from __future__ import annotations

import argparse
import logging
import os

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.bench import load_prompts
from laguna_dflash.demo import demo_pair, heldout_prompts


def acceptance(target: str, draft: str, prompts: list[str], params: SamplingParams, dtype: str,
               k: int, quantization: str | None, **engine_options) -> tuple[float, list[list[int]]]:
    """(mean acceptance length, each prompt's output tokens) of one engine."""
    llm = LLM(target, draft, dtype=dtype, num_speculative_tokens=k, draft_quantization=quantization,
              **engine_options)
    outs = llm.generate(prompts, params)
    return llm.get_metrics()["mean_acceptance_length"], [o.token_ids for o in outs]


def pair_and_prompts(args: argparse.Namespace) -> tuple[str, str, list[str], str]:
    """(target dir, draft dir, prompts, a label for the table's title) from the flags."""
    if (args.model is None) != (args.draft is None):
        raise SystemExit("give --model and --draft together (a real pair), or neither (the demo pair)")
    if args.model is None:
        target, draft = demo_pair()
        label = "demo pair"
    else:
        target, draft, label = args.model, args.draft, f"{args.model} with {args.draft}"
    if args.prompts is None:
        prompts = heldout_prompts()
    elif not os.path.isfile(args.prompts):
        raise SystemExit(f"--prompts {args.prompts}: no such file; pass a JSON list or JSON Lines file of prompts")
    else:
        prompts = load_prompts(args.prompts)
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            raise SystemExit(f"--num-prompts must be >= 1, got {args.num_prompts}")
        prompts = prompts[: args.num_prompts]
    return str(target), str(draft), prompts, label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ks", default="3,7")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", help="target checkpoint directory (default: the embedded demo pair's)")
    ap.add_argument("--draft", help="drafter checkpoint directory (with --model)")
    ap.add_argument("--prompts", help="JSON list / JSON Lines of prompts (default: the demo's held-out set)")
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp8 runs its fp8 kernels on cuda)")
    ap.add_argument("--max-model-len", type=int, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    target, draft, prompts, label = pair_and_prompts(args)
    engine_options = {"device": args.device}
    if args.max_model_len is not None:
        engine_options["max_model_len"] = args.max_model_len
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"{label}, {len(prompts)} prompts, greedy, {args.max_tokens} new tokens, {args.device}")
    print("| dtype | K | as loaded | fp8 | change | outputs equal to target-only's (as loaded, fp8) |")
    print("|---|---:|---:|---:|---:|---|")
    for dtype in args.dtypes.split(","):
        base = [o.token_ids for o in LLM(target, dtype=dtype, **engine_options).generate(prompts, params)]
        for k in (int(v) for v in args.ks.split(",")):
            plain, plain_tokens = acceptance(target, draft, prompts, params, dtype, k, None, **engine_options)
            fp8, fp8_tokens = acceptance(target, draft, prompts, params, dtype, k, "fp8", **engine_options)
            same = [sum(a == b for a, b in zip(tokens, base)) for tokens in (plain_tokens, fp8_tokens)]
            print(f"| {dtype} | {k} | {plain:.4f} | {fp8:.4f} | {100 * (fp8 / plain - 1):+.2f}% "
                  f"| {same[0]}, {same[1]} of {len(prompts)} |")


if __name__ == "__main__":
    main()
