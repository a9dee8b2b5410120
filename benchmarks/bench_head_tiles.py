"""Can the Q|K|V|gate GEMM run one attention head (128 output rows) a program at full speed?

The per-layer Q/K norm + RoPE + cache kernel (~2.2 us of a decode layer's span) exists because
RMSNorm over a head needs all 128 outputs of that head, and the measured Q|K|V|gate configs give
each program 16 (GEMV, M = 1) or 64 (dot path, M = 4) of them. A program that owns a whole head
could apply the norm, RoPE and the cache write in its epilogue, with no cross-program step,
but the grid shrinks to ~80 programs (64 / 48 query heads + 16 K/V heads + the gate rows) on
132 SMs. This times that grid against the measured default, in the same process, with the
skinny GEMM benchmark's method (CUDA graph over weight copies > L2, best of 3, checked against
an fp32 reference): if the 128-row tiles lose more than the ~2 us the epilogue would save, the
fold is not worth building.

    python benchmarks/bench_head_tiles.py
    TRITON_INTERPRET=1 python benchmarks/bench_head_tiles.py --device cpu --tiny   # wiring
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_skinny_gemm import Case, fmt_cfg  # noqa: E402

from laguna_dflash.kernels import skinny_gemm as sg  # noqa: E402
from laguna_dflash.kernels.skinny_gemm import SkinnyConfig  # noqa: E402

SHAPES = [("qkvg, 64 heads", 10304, 2048), ("qkvg, 48 heads", 8240, 2048)]
TINY_SHAPES = [("tiny", 272, 256)]
HEAD_DIM = 128


def head_configs(m: int, tiny: bool) -> list[SkinnyConfig]:
    """Whole-head tiles (block_n = 128, no split-K): the dot path by block_k x stages x warps,
    and at M = 1 the GEMV path too (its accumulators: 128 x block_k fp32 across the program)."""
    out = []
    for bk in (64,) if tiny else (64, 128, 256):
        for stages in (2,) if tiny else (2, 3, 4):
            for warps in (4,) if tiny else (4, 8):
                if HEAD_DIM * bk * 2 * stages <= 200 * 1024:
                    out.append(SkinnyConfig(HEAD_DIM, bk, 1, warps, stages, use_dot=True))
    if m == 1:
        for bk in (32,) if tiny else (16, 32, 64):
            for warps in (4,) if tiny else (4, 8):
                out.append(SkinnyConfig(HEAD_DIM, bk, 1, warps, 2, use_dot=False))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,4", help="rows of x (comma list)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="one small shape, few configs (CPU wiring)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print("| shape | M | default config | us | best whole-head config | us | ratio |")
    print("|---|---:|---|---:|---|---:|---:|")
    for name, n, k in TINY_SHAPES if args.tiny else SHAPES:
        for m in (int(v) for v in args.m.split(",")):
            case = Case(name, n, k, m, device, args.tiny)
            default = sg.default_config(m, n, k)
            default_us = case.time_config(default)
            for cfg in head_configs(m, args.tiny):
                case.time_config(cfg)
            heads = [(us, cfg) for us, cfg in case.ranked() if cfg.block_n == HEAD_DIM and cfg.split_k == 1]
            if default_us is None or not heads:
                print(f"| {name} | {m} | {fmt_cfg(default)} | {default_us} | none ran | | |")
            else:
                us, cfg = heads[0]
                print(f"| {name} | {m} | {fmt_cfg(default)} | {default_us:.2f} | {fmt_cfg(cfg)} | "
                      f"{us:.2f} | {us / default_us:.2f} |")
            for line in case.wrong:
                print(f"  skipped {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
