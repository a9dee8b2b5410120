"""The fp8 drafter's GEMMs past 16 rows (batch 4 and more at K = 3): ``skinny_gemm_rows`` on the
e4m3 weight, at the config ``fp8_linear`` derives and a few others, against cuBLAS ``F.linear``
on the bf16 weight (what the drafter as loaded runs there). Each time is a CUDA graph of 20
launches cycling through weight copies totalling >= 256 MiB (W from HBM, as in a forward), best
of 3, in us a launch; every candidate is checked against the dequantized weight's fp32 product
first. Prints one markdown table::

    python benchmarks/bench_fp8_rows.py                          # lm_head, gate|up at 48 / 192 / 256 rows
    python benchmarks/bench_fp8_rows.py --m 64 --shapes 100352x2048
    TRITON_INTERPRET=1 python benchmarks/bench_fp8_rows.py --device cpu --tiny   # wiring check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels import skinny_gemm as sg  # noqa: E402
from laguna_dflash.kernels.skinny_gemm import SkinnyConfig  # noqa: E402
from laguna_dflash.models.fp8 import dequantize_rows, quantize_rows  # noqa: E402

# (block_n, block_k, num_warps, num_stages) tried besides the derived config (dot path, split_k 1)
CANDIDATES = [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3),
              (256, 128, 8, 3), (64, 256, 2, 4), (128, 128, 2, 4)]


def time_us(fn, num_copies: int, device: str, reps: int = 20) -> float:
    """Best of 3: one launch's time in us, from a CUDA graph of ``reps`` launches (copy ``i %
    num_copies``); on the CPU one eager call."""
    if device != "cuda":
        import time
        t = time.perf_counter()
        fn(0)
        return (time.perf_counter() - t) * 1e6
    for i in range(2):
        fn(i % num_copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % num_copies)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="48,192,256", help="rows of x (comma list, each > 16)")
    ap.add_argument("--shapes", default="100352x2048,16384x2048", help="NxK weights (comma list)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, two candidates (CPU wiring check)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = args.device
    shapes = [(256, 128)] if args.tiny else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [17, 40] if args.tiny else [int(v) for v in args.m.split(",")]
    candidates = CANDIDATES[:2] if args.tiny else CANDIDATES
    print("| N x K | M | cuBLAS bf16 us | fp8 derived config us | best fp8 config | us | bf16 / best fp8 |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for n, k in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        num_copies = 1 if dev != "cuda" else max(2, -(-256 * 2**20 // (n * k)))
        quantized, scale = quantize_rows(w)
        qs = [quantized] + [quantized.clone() for _ in range(num_copies - 1)]
        ws = [w] + [w.clone() for _ in range(num_copies - 1)] if dev == "cuda" else [w]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ dequantize_rows(quantized, scale, torch.float32).T
            t_cublas = time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i % len(ws)]), len(ws), dev)
            derived = sg.default_config(sg.MAX_M, n, k, fp8=True)
            rows = [("derived", derived)] + [
                (f"{bn} x {bk}, {nw} warps, {ns} stages",
                 SkinnyConfig(block_n=bn, block_k=bk, split_k=1, num_warps=nw, num_stages=ns, use_dot=True,
                              evict_first=True, x_bcast=True))
                for bn, bk, nw, ns in candidates]
            timed = []
            for name, cfg in rows:
                try:
                    y = sg.skinny_gemm_rows(x, quantized, cfg, scale=scale)
                    err = (y.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                    if err > 2e-2:
                        print(f"  {name}: wrong (relative error {err:.3g}), skipped")
                        continue
                    timed.append((time_us(lambda i, c=cfg, x=x, qs=qs, s=scale: sg.skinny_gemm_rows(x, qs[i], c, scale=s),
                                          num_copies, dev), name))
                except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run (shared memory)
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:80]}")
            if not timed:
                continue
            t_derived = next((t for t, name in timed if name == "derived"), float("nan"))
            t_best, best = min(timed)
            print(f"| {n} x {k} | {m} | {t_cublas:.1f} | {t_derived:.1f} | {best} | {t_best:.1f} "
                  f"| {t_cublas / t_best:.2f} |")


if __name__ == "__main__":
    main()
