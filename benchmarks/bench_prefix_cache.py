"""What a prefix-cache hit saves: the prefill step of prompts whose prefix is cached, against the
same prompts computed whole, in one process (Laguna-XS-2.1 pair, dummy weights, bf16 on CUDA).

Rows (each the best of ``--rounds`` after a warm-up round):

* cold: ``--context`` random tokens, the cache emptied first (the whole prompt computed);
* same prompt again: all but its last block from the cache;
* cached prefix + ``--suffix`` new tokens: a shared system prompt / file, a new question;
* batch of 4 sharing the prefix: four prompts, the prefix cached, each with its own suffix,
  against the same four with the cache emptied; sent together with the cache emptied, three of
  them wait a step for the first one's prefix (engine/scheduler.py), so "batch 4, cold" computes
  the prefix once. "batch 4, cold, side by side" turns that wait off
  (``scheduler.wait_for_shared_prefixes``): each computes it, as before.

The first generated token of every cached run is checked against the cold run's. On CUDA one
more run of each case under ``torch.profiler`` sums its GPU kernel time: a step whose wall time
is far above it waits on the host (launches), not on the GPU::

    python benchmarks/bench_prefix_cache.py                 # H200: 40 layers, 1k context
    python benchmarks/bench_prefix_cache.py --device cpu --layers 2 --hidden 256 --context 64
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from bench_gpu_xs import add_xs_pair_args, xs_pair_llm

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine import scheduler


def timed_prefill(llm: LLM, prompts: list[list[int]], cold: bool) -> tuple[float, int, list[int]]:
    """(seconds of the prefill step, prompt tokens found cached, first tokens) of ``prompts``
    (one token each: no decode step); ``cold`` empties the prefix cache first."""
    if cold:
        llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    before = llm.get_metrics()["prefill_s"]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return (llm.get_metrics()["prefill_s"] - before, sum(o.num_cached_tokens for o in outs),
            [o.token_ids[0] for o in outs])


def kernel_ms(llm: LLM, prompts: list[list[int]], cold: bool) -> float:
    """Summed CUDA kernel milliseconds of one :func:`timed_prefill` (profiled)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_prefill(llm, prompts, cold)
        torch.cuda.synchronize()
    return sum(e.time_range.end - e.time_range.start for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    add_xs_pair_args(ap, new_tokens=1, rounds=3, new_tokens_help="unused (prefill only)")
    ap.add_argument("--suffix", type=int, default=64, help="new tokens after the cached prefix")
    args = ap.parse_args()
    rng = random.Random(0)
    max_len = args.context + args.suffix + 64
    rows: dict[str, list[tuple[float, int, bool]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        llm, tcfg = xs_pair_llm(args, Path(tmp), max_len, 4, num_speculative_tokens=3)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, tcfg["vocab_size"]) for _ in range(n)]

        prefix = tokens(args.context)
        for r in range(args.rounds + 1):  # round 0: warm-up (compiles, graphs)
            suffixes = [tokens(args.suffix) for _ in range(4)]
            cold_t, _, want = timed_prefill(llm, [prefix], cold=True)
            cases = {"cold (whole prompt)": (cold_t, 0, True)}
            t, hit, got = timed_prefill(llm, [prefix], cold=False)
            cases["same prompt again"] = (t, hit, got == want)
            _, _, want_suffix = timed_prefill(llm, [prefix + suffixes[0]], cold=True)
            timed_prefill(llm, [prefix], cold=True)  # the prefix alone cached
            t, hit, got = timed_prefill(llm, [prefix + suffixes[0]], cold=False)
            cases[f"cached prefix + {args.suffix} new"] = (t, hit, got == want_suffix)
            batch = [prefix + s for s in suffixes]
            scheduler.wait_for_shared_prefixes = False
            t, _, want_batch = timed_prefill(llm, batch, cold=True)
            scheduler.wait_for_shared_prefixes = True
            cases["batch 4, cold, side by side"] = (t, 0, True)
            t, hit, got = timed_prefill(llm, batch, cold=True)
            cases["batch 4, cold"] = (t, hit, got == want_batch)
            timed_prefill(llm, [prefix], cold=True)
            t, hit, got = timed_prefill(llm, batch, cold=False)
            cases["batch 4, prefix cached"] = (t, hit, got == want_batch)
            if r:
                for name, row in cases.items():
                    rows.setdefault(name, []).append(row)
        gpu: dict[str, float] = {}
        if args.device.startswith("cuda"):  # the same five prefills, profiled once
            gpu["cold (whole prompt)"] = kernel_ms(llm, [prefix], cold=True)
            gpu["same prompt again"] = kernel_ms(llm, [prefix], cold=False)
            suffixed = [prefix + s for s in suffixes]
            timed_prefill(llm, [prefix], cold=True)
            gpu[f"cached prefix + {args.suffix} new"] = kernel_ms(llm, suffixed[:1], cold=False)
            scheduler.wait_for_shared_prefixes = False
            gpu["batch 4, cold, side by side"] = kernel_ms(llm, suffixed, cold=True)
            scheduler.wait_for_shared_prefixes = True
            gpu["batch 4, cold"] = kernel_ms(llm, suffixed, cold=True)
            timed_prefill(llm, [prefix], cold=True)
            gpu["batch 4, prefix cached"] = kernel_ms(llm, suffixed, cold=False)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# {name}, XS-2.1 pair ({args.layers} layers), context {args.context}, suffix "
          f"{args.suffix}, DFlash K=3 loaded (the prefill stores the drafter's context); best of "
          f"{args.rounds}")
    print("| prefill of | cached tokens | ms | x cold | GPU kernels ms | first token = uncached |")
    print("|---|---:|---:|---:|---:|---|")
    cold = min(t for t, _, _ in rows["cold (whole prompt)"])
    cold_batch = min(t for t, _, _ in rows["batch 4, cold, side by side"])
    for case, runs in rows.items():
        best = min(t for t, _, _ in runs)
        base = cold_batch if case.startswith("batch") else cold
        same = all(ok for _, _, ok in runs)
        kernels = f"{gpu[case]:.2f}" if case in gpu else "-"
        print(f"| {case} | {runs[0][1]} | {best * 1e3:.2f} | {best / base:.2f} | {kernels} | "
              f"{same} |")


if __name__ == "__main__":
    main()
