"""Where a prefill step's time goes, eager against replayed from a CUDA graph (padded,
``EngineConfig.max_prefill_graph_tokens``), in one process: wall time, summed GPU kernel time and
the kernels launched, by new tokens, with and without a cached prefix (Laguna-XS-2.1 pair, dummy
weights, bf16 on CUDA).

A step whose wall time is far above its kernel time waits on the host (launch work, or a sync),
not on the GPU. ``--top N`` prints the N costliest kernels and host ops of the first eager case
under ``torch.profiler``, so the cause can be named. Prefills past the largest graph bucket run
eagerly in both modes (a control)::

    python benchmarks/bench_prefill.py                            # H200: 40 layers
    python benchmarks/bench_prefill.py --new 16,64 --prefix 0,1024 --top 12
    python benchmarks/bench_prefill.py --max-prefill-graph-tokens 4096 --new 1024,2048,4096 --prefix 0
    python benchmarks/bench_prefill.py --device cpu --layers 2 --hidden 256 --new 16 --prefix 0,64

On the CPU (a wiring check) the "graphs" rows run the graph runner's padded forward eagerly.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from bench_gpu_xs import add_xs_pair_args, xs_pair_llm

from laguna_dflash import LLM, SamplingParams


def prefill_s(llm: LLM, prompt: list[int], prefix_len: int) -> tuple[float, int]:
    """(seconds of the prefill step of ``prompt``, its one sampled token) with its first
    ``prefix_len`` tokens (whole blocks) cached beforehand, none when 0."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if prefix_len:
        llm.generate(prompt_token_ids=[prompt[:prefix_len]], sampling_params=params)
    before = llm.get_metrics()["prefill_s"]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.num_cached_tokens >= (prefix_len // 16) * 16 - 16, out.num_cached_tokens
    return llm.get_metrics()["prefill_s"] - before, out.token_ids[0]


def profiled(llm: LLM, prompt: list[int], prefix_len: int, top: int) -> tuple[float, int, float]:
    """(GPU kernel ms, kernels launched, host ms) of one :func:`prefill_s` step; ``top`` > 0
    prints its costliest kernels and host ops."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if prefix_len:
        llm.generate(prompt_token_ids=[prompt[:prefix_len]], sampling_params=params)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        before = llm.get_metrics()["prefill_s"]
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        host = llm.get_metrics()["prefill_s"] - before
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3
    if top:
        table = prof.key_averages()
        print(table.table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))
        print(table.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    return gpu_ms, len(kernels), host * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    add_xs_pair_args(ap, new_tokens=1, rounds=3, new_tokens_help="unused (prefill only)")
    ap.add_argument("--new", default="16,64,256,1024", help="new (computed) tokens per case")
    ap.add_argument("--prefix", default="0,1024", help="cached prefix lengths (multiples of 16)")
    ap.add_argument("--top", type=int, default=0, help="print the top kernels / host ops of the first case")
    ap.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                    help="EngineConfig.max_prefill_graph_tokens (default: the engine's, 2048)")
    args = ap.parse_args()
    news = [int(n) for n in args.new.split(",")]
    prefixes = [int(p) for p in args.prefix.split(",")]
    rng = random.Random(0)
    max_len = max(news) + max(prefixes) + 64
    is_cuda = args.device.startswith("cuda")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        options = {} if args.max_prefill_graph_tokens is None else {
            "max_prefill_graph_tokens": args.max_prefill_graph_tokens}
        llm, tcfg = xs_pair_llm(args, Path(tmp), max_len, 2, num_speculative_tokens=3, **options)
        if not is_cuda:  # the CPU wiring check: the graph runners' padded forward, run eagerly
            llm.engine.attach_graph_runners()
        graphs = llm.engine.runner.graphs
        buckets = graphs.prefill_buckets if graphs is not None else ()
        cases = [(p, n) for p in prefixes for n in news]
        prompts = {c: [rng.randrange(3, tcfg["vocab_size"]) for _ in range(sum(c))] for c in cases}
        first: dict[tuple[int, int], int] = {}
        for mode in ("eager", "graphs") if buckets else ("eager",):
            if graphs is not None:  # the same engine: only the prefill route changes
                graphs.prefill_buckets = buckets if mode == "graphs" else ()
            for p, n in cases:  # warm-up: compiles and captures of each shape
                prefill_s(llm, prompts[p, n], p)
            for i, (p, n) in enumerate(cases):
                runs = [prefill_s(llm, prompts[p, n], p) for _ in range(args.rounds)]
                best = min(t for t, _ in runs) * 1e3
                same = first.setdefault((p, n), runs[0][1]) == runs[0][1]
                top = args.top if i == 0 and mode == "eager" else 0
                gpu = profiled(llm, prompts[p, n], p, top) if is_cuda else None
                rows.append((mode, p, n, best, gpu, same))
    name = torch.cuda.get_device_name() if is_cuda else "cpu"
    print(f"# {name}, XS-2.1 pair ({args.layers} layers), DFlash K=3 loaded (the prefill stores "
          f"the drafter's context), best of {args.rounds}; profiled run: one more step; graph "
          f"buckets {buckets}")
    print("| prefill | cached prefix | new tokens | step ms | x eager | GPU kernels ms | kernels | "
          "profiled step ms | first token = eager's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    eager = {(p, n): best for mode, p, n, best, _, _ in rows if mode == "eager"}
    for mode, p, n, best, gpu, same in rows:
        g = f"{gpu[0]:.2f} | {gpu[1]} | {gpu[2]:.2f}" if gpu else "- | - | -"
        print(f"| {mode} | {p} | {n} | {best:.2f} | {best / eager[p, n]:.2f} | {g} | {same} |")


if __name__ == "__main__":
    main()
