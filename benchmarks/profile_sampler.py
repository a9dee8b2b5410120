"""Where a sampled step's GPU time goes: ``sample_rows`` per sampling mode, as device time.

``bench_sampler.py`` times wall clock with the device synchronised after each call, which at
batch 1 is mostly the host's launches. In the engine the host queues the next step's forward
before it waits for the tokens, so what a sampled request costs a decode step is the device
time of its kernels. This script measures that, two ways, for each mode and row count:

* ``graph us``: ``--iters`` calls captured in one CUDA graph, the replay timed with events
  (median of 5) / iters: device time with no launch gaps (modes without uploads only);
* ``kernels us``: the kernels' device time per call under ``torch.profiler`` (eager), and the
  largest kernels by name.

Compare two trees by running it in each (the claim is the ratio of the two, on one device; the
thirty-second pass ran the two-stage top-k candidate, on a branch not kept).

    python benchmarks/profile_sampler.py                          # on the H200, V = 100352
    python benchmarks/profile_sampler.py --device cpu --vocab 4096 --rows 1 --iters 3  # wiring
    python benchmarks/profile_sampler.py --switch laguna_dflash.engine.sampler:chunk_long_rows=False \
        --switch laguna_dflash.kernels.topk_values:USE_KERNEL=True  # each case again, each switch set
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from bench_gpu_xs import switch_error
from host_timeline import switched

from laguna_dflash.config import SamplingParams
from laguna_dflash.engine.sampler import sample_rows

MODES = {
    "greedy": dict(temperature=0.0),
    "temp": dict(temperature=0.7),
    "top-k20": dict(temperature=0.7, top_k=20),  # the server's default top-k for Laguna
    "top-k20+top-p": dict(temperature=0.7, top_k=20, top_p=0.95),
    "top-k50+top-p": dict(temperature=0.7, top_k=50, top_p=0.95),
    "top-p": dict(temperature=0.7, top_p=0.95),  # the full sort
    "seeded+top-k20": dict(temperature=0.7, top_k=20, top_p=0.95),  # + seed = row
}


def _params(mode: str, rows: int) -> list[SamplingParams]:
    seeded = mode.startswith("seeded")
    return [SamplingParams(**MODES[mode], seed=i if seeded else None, max_tokens=1 << 20)
            for i in range(rows)]


def graph_us(call, iters: int) -> float:
    """Device us per call: ``iters`` calls in one CUDA graph, its replay timed (median of 5)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def kernel_us(call, iters: int, device: torch.device, top: int) -> tuple[float, list[tuple[str, float]]]:
    """Device us per call under torch.profiler (eager), and the ``top`` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    call()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
    per_kernel = []
    for e in prof.key_averages():
        if device.type == "cuda" and str(getattr(e, "device_type", "")).endswith("CPU"):
            continue
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if device.type != "cuda":
            t = e.self_cpu_time_total
        if t > 0:
            per_kernel.append((e.key, t / iters))
    per_kernel.sort(key=lambda kv: -kv[1])
    total = sum(t for _, t in per_kernel) if device.type == "cuda" else float("nan")
    return total, per_kernel[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=100352)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,4,64", help="rows of logits a call (comma list)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=4, help="kernels listed per case")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--switch", action="append", default=[], metavar="MODULE:ATTR=VALUE",
                    help="e.g. laguna_dflash.kernels.topk_values:USE_KERNEL=True: each case is timed "
                         "again with it set, in the same process (repeatable; one row each)")
    args = ap.parse_args()
    for text in args.switch:  # parsed and imported now, not mid-table
        if error := switch_error(text):
            ap.error(f"argument --switch: {error}")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; one of {', '.join(MODES)}")
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"sample_rows device time; V = {args.vocab}, {args.dtype}, {device}")
    print("| rows | mode | graph us | kernels us | largest kernels (us a call) |")
    print("|---:|---|---:|---:|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, args.vocab, device=device, generator=gen) * 2).to(dtype)
        for mode in modes:
            for switch in [None, *args.switch]:
                label = mode if switch is None else f"{mode} ({switch.split(':')[-1]})"
                with switched([switch] if switch else []):
                    _print_case(rows, label, logits, mode, device, args)


def _print_case(rows: int, label: str, logits: torch.Tensor, mode: str, device: torch.device,
                args: argparse.Namespace) -> None:
    """One table row: ``mode`` on ``logits [rows, V]``, graph and profiler device times."""
    # the default generator: a graph captures it without registration
    call = functools.partial(sample_rows, logits, _params(mode, rows), list(range(rows)))
    graph = "-"
    if device.type == "cuda" and not mode.startswith("seeded"):  # seeds are an upload
        try:
            graph = f"{graph_us(call, args.iters):.1f}"
        except Exception as e:  # noqa: BLE001 - the eager columns still count
            graph = f"capture failed: {type(e).__name__}"
    total, kernels = kernel_us(call, args.iters, device, args.top)
    listed = "; ".join(f"{name[:48]} {t:.1f}" for name, t in kernels)
    print(f"| {rows} | {label} | {graph} | {total:.1f} | {listed} |")


if __name__ == "__main__":
    main()
