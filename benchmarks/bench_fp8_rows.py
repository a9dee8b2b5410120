"""The fp8 drafter's GEMMs by row count: past 16 rows (batch 5 and more at K = 3)
``skinny_gemm_rows`` on the e4m3 weight, up to 16 the one-launch ``skinny_gemm`` the drafter
runs there, each at the config the tables give (``default_config``) and at eight others, against
cuBLAS ``F.linear`` on the bf16 weight (what the drafter as loaded runs). Timed as
``bench_skinny_gemm.py`` times (its ``time_graph``: one CUDA graph of a launch per weight copy,
the copies >= 256 MiB so W comes from HBM as in a forward, best of 3), in us a launch; every
candidate is checked against the dequantized weight's fp32 product first. Prints one markdown
table::

    python benchmarks/bench_fp8_rows.py                          # lm_head, gate|up at 48 / 192 / 256 rows
    python benchmarks/bench_fp8_rows.py --m 64 --shapes 100352x2048
    python benchmarks/bench_fp8_rows.py --m 8,16 --each           # one launch; every config's time
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

# (block_n, block_k, num_warps, num_stages) tried besides the configured one (dot path, split_k
# 1); 64 x 256 at 4 warps is what the tables gave at 8 and 16 rows before the seventy-second pass
CANDIDATES = [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3),
              (256, 128, 8, 3), (64, 256, 2, 4), (128, 128, 2, 4), (64, 256, 4, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="48,192,256",
                    help="rows of x (comma list; up to 16: the one-launch skinny_gemm)")
    ap.add_argument("--shapes", default="100352x2048,16384x2048", help="NxK weights (comma list)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, two candidates (CPU wiring check)")
    ap.add_argument("--each", action="store_true", help="a line with every config's time before each row")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = args.device
    timer = time_graph if dev == "cuda" else time_cpu
    shapes = [(256, 128)] if args.tiny else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [5, 17, 40] if args.tiny else [int(v) for v in args.m.split(",")]
    candidates = CANDIDATES[:2] if args.tiny else CANDIDATES
    print("| N x K | M | cuBLAS bf16 us | fp8 as configured us | best fp8 config | us | bf16 / best fp8 |")
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
            configured = sg.default_config(min(m, sg.MAX_M), n, k, fp8=True)

            def launch(x, q, c, s, rows_path=m > sg.MAX_M):
                return (sg.skinny_gemm_rows(x, q, c, scale=s) if rows_path
                        else sg.skinny_gemm(x, q, config=c, scale=s))

            rows = [("configured", configured)] + [
                (f"{bn} x {bk}, {nw} warps, {ns} stages",
                 SkinnyConfig(block_n=bn, block_k=bk, split_k=1, num_warps=nw, num_stages=ns, use_dot=True,
                              evict_first=True, x_bcast=True))
                for bn, bk, nw, ns in candidates]
            timed = []
            for name, cfg in rows:
                try:
                    y = launch(x, quantized, cfg, scale)
                    err = (y.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                    if err > 2e-2:
                        print(f"  {name}: wrong (relative error {err:.3g}), skipped")
                        continue
                    timed.append((timer([lambda x=x, q=q, c=cfg, s=scale: launch(x, q, c, s)
                                         for q in qs]), name))
                except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run (shared memory)
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:80]}")
            if not timed:
                continue
            if args.each:
                print(f"  {n} x {k}, {m} rows (us): " + "; ".join(f"{name} {t:.1f}" for t, name in timed))
            t_configured = next((t for t, name in timed if name == "configured"), float("nan"))
            t_best, best = min(timed)
            print(f"| {n} x {k} | {m} | {t_cublas:.1f} | {t_configured:.1f} | {best} | {t_best:.1f} "
                  f"| {t_cublas / t_best:.2f} |")


if __name__ == "__main__":
    main()
