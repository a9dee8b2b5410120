"""What ``--draft-quantization fp8`` does to draft quality: the mean acceptance length of the
embedded demo pair's drafter as loaded and in fp8, on its held-out prompts (greedy), per dtype
and K, and how many outputs equal target-only's (float32: all must; bfloat16 rounds by batch
shape). Runs on the CPU (the fp8 weights are dequantized for ``F.linear`` there: the same values
the GPU kernel multiplies). Prints a short table::

    python benchmarks/bench_draft_quantization.py                      # float32 / bfloat16, K 3 / 7
    python benchmarks/bench_draft_quantization.py --dtypes float32 --ks 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import logging

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.demo import demo_pair, heldout_prompts


def acceptance(target: str, draft: str, prompts: list[str], params: SamplingParams, dtype: str,
               k: int, quantization: str | None) -> tuple[float, list[list[int]]]:
    """(mean acceptance length, each prompt's output tokens) of one engine."""
    llm = LLM(target, draft, dtype=dtype, num_speculative_tokens=k, draft_quantization=quantization)
    outs = llm.generate(prompts, params)
    return llm.get_metrics()["mean_acceptance_length"], [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ks", default="3,7")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    target, draft = demo_pair()
    prompts = heldout_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"demo pair, {len(prompts)} held-out prompts, greedy, {args.max_tokens} new tokens")
    print("| dtype | K | as loaded | fp8 | change | outputs equal to target-only's (as loaded, fp8) |")
    print("|---|---:|---:|---:|---:|---|")
    for dtype in args.dtypes.split(","):
        base = [o.token_ids for o in LLM(target, dtype=dtype).generate(prompts, params)]
        for k in (int(v) for v in args.ks.split(",")):
            plain, plain_tokens = acceptance(target, draft, prompts, params, dtype, k, None)
            fp8, fp8_tokens = acceptance(target, draft, prompts, params, dtype, k, "fp8")
            same = [sum(a == b for a, b in zip(tokens, base)) for tokens in (plain_tokens, fp8_tokens)]
            print(f"| {dtype} | {k} | {plain:.4f} | {fp8:.4f} | {100 * (fp8 / plain - 1):+.2f}% "
                  f"| {same[0]}, {same[1]} of {len(prompts)} |")


if __name__ == "__main__":
    main()
