"""The fp8 drafter's GEMMs past 16 rows (batch 4 and more at K = 3): ``skinny_gemm_rows`` on the
e4m3 weight, at the config derived from the bf16 table and seven others, against cuBLAS
``F.linear`` on the bf16 weight (what the drafter as loaded runs there). Timed as
``bench_skinny_gemm.py`` times (its ``time_graph``: one CUDA graph of a launch per weight copy,
the copies >= 256 MiB so W comes from HBM as in a forward, best of 3), in us a launch; every
candidate is checked against the dequantized weight's fp32 product first. Prints one markdown
table::

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_skinny_gemm import time_cpu, time_graph  # noqa: E402

# (block_n, block_k, num_warps, num_stages) tried besides the derived config (dot path, split_k 1)
CANDIDATES = [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3),
              (256, 128, 8, 3), (64, 256, 2, 4), (128, 128, 2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="48,192,256", help="rows of x (comma list, each > 16)")
    ap.add_argument("--shapes", default="100352x2048,16384x2048", help="NxK weights (comma list)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, two candidates (CPU wiring check)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = args.device
    timer = time_graph if dev == "cuda" else time_cpu
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
            t_cublas = timer([lambda x=x, w=w: F.linear(x, w) for w in ws])
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
                    timed.append((timer([lambda x=x, q=q, c=cfg, s=scale: sg.skinny_gemm_rows(x, q, c, scale=s)
                                         for q in qs]), name))
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
