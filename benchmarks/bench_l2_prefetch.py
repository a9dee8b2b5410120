"""Does a weight prefetched into L2 (kernels/l2_prefetch.py) make the GEMM after it faster? H200.

For each weight shape (``N x K`` bf16; the defaults are XS-2.1's ``o_proj``, Q|K|V|gate, and one
larger than L2), times the batch-1 GEMM ``x [1, K] @ W^T`` (the skinny GEMM, and cuBLAS) with
CUDA events around the GEMM alone, after each of:

* ``cold``: L2 flushed (a 256 MiB buffer zeroed), then a ``torch.cuda._sleep`` of ``--sleep-us``;
* ``prefetched``: flushed, the prefetch kernel (``--programs`` programs), the same sleep (time for
  the prefetch to land);
* ``prefetch, no sleep``: flushed, the prefetch kernel, the GEMM at once (the head start only);
* ``warm``: the GEMM run twice, the second timed (as much of W as L2 kept).

Median of ``--reps``; also the prefetch kernel's own time (issue only). Prints a markdown table.

    python benchmarks/bench_l2_prefetch.py
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels import l2_prefetch, skinny_gemm  # noqa: E402

SHAPES = [("o_proj", 2048, 8192), ("qkvg", 10304, 2048), ("2x L2", 25000, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sleep-us", type=float, default=20.0)
    ap.add_argument("--programs", default="66,132,264")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    clock_hz = torch.cuda.get_device_properties(dev).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.98e9
    sleep_cycles = int(args.sleep_us * 1e-6 * clock_hz)
    programs = [int(p) for p in args.programs.split(",")]

    def timed(before, gemm) -> float:
        times = []
        for _ in range(args.reps):
            flush.zero_()
            before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gemm()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    print(f"L2 {torch.cuda.get_device_properties(dev).L2_cache_size / 2**20:.0f} MiB, sleep "
          f"{args.sleep_us} us ({sleep_cycles} cycles), median of {args.reps}\n")
    print("| weight | MB | GEMM | cold us | prefetched (programs) us | prefetch, no sleep us | warm us | prefetch kernel us |")
    print("|---|---:|---|---:|---|---:|---:|---:|")
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        gemms = {"skinny": functools.partial(skinny_gemm.skinny_gemm, x, w),
                 "cuBLAS": functools.partial(F.linear, x, w)}
        for label, gemm in gemms.items():
            gemm()  # compile
            row = [f"{name} {n}x{k}", f"{w.numel() * 2 / 1e6:.1f}", label,
                   f"{timed(functools.partial(torch.cuda._sleep, sleep_cycles), gemm):.1f}"]
            pre = []
            for p in programs:
                def prefetch_then_sleep(p=p, w=w):
                    l2_prefetch.prefetch_l2(w, p)
                    torch.cuda._sleep(sleep_cycles)
                pre.append(f"{timed(prefetch_then_sleep, gemm):.1f} ({p})")
            prefetch = functools.partial(l2_prefetch.prefetch_l2, w, programs[len(programs) // 2])
            row += [", ".join(pre), f"{timed(prefetch, gemm):.1f}", f"{timed(gemm, gemm):.1f}",
                    f"{timed(lambda: None, prefetch):.1f}"]
            print("| " + " | ".join(row) + " |")

if __name__ == "__main__":
    main()
