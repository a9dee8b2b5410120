"""How fast can ONE kernel read N bytes of HBM on this GPU, by bytes in flight and size?

The batch-1 decode's weight kernels (the Q|K|V|gate GEMM, the MoE GEMVs) read 19-42 MB each and
ncu times them, alone, at 2.4-3.2 TB/s (docs/PERFORMANCE.md, sixteenth pass) against a 4.2-4.3 TB/s
copy rate. This separates what any kernel of that size pays (launch ramp, first-load latency,
tail) from what the GEMV formulation costs: a streaming read with no math but a sum, whose bytes
in flight per program are set by the tile (``--loads``: 16-byte loads a thread an iteration, one
iteration loaded ahead) and the program count.

Each cell: a CUDA graph of launches over 4 copies of the buffer (>= 4 x the size: the L2 does
not hold them), back to back with no PDL, so one launch's time includes its ramp and tail as in
ncu's isolated timing. Best of 3 x 10 replays (``bench_skinny_gemm.time_graph``); TB/s counts
the buffer's bytes.

    python benchmarks/bench_read_roofline.py
    TRITON_INTERPRET=1 python benchmarks/bench_read_roofline.py --device cpu --tiny   # wiring
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels.jit import jit_functions  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_skinny_gemm import time_graph  # noqa: E402  (one CUDA-graph timer for the benchmarks)

if TYPE_CHECKING:
    import triton.language as tl


def _read_kernel(src_ptr, out_ptr, ELEMS_PER_PROG: tl.constexpr, LOADS: tl.constexpr,
                 ITERS: tl.constexpr, NUM_WARPS: tl.constexpr):
    # program p sums its contiguous ELEMS_PER_PROG elements, [threads, LOADS, 8] a tile (one
    # 16-byte load a thread per LOADS slot), the next tile's loads issued before this tile's adds
    p = tl.program_id(0).to(tl.int64)
    threads: tl.constexpr = NUM_WARPS * 32
    tile: tl.constexpr = threads * LOADS * 8
    offs = (tl.arange(0, threads)[:, None, None] * 8 + tl.arange(0, LOADS)[None, :, None] * (threads * 8)
            + tl.arange(0, 8)[None, None, :])
    base = src_ptr + p * ELEMS_PER_PROG
    acc = tl.zeros([threads, LOADS], dtype=tl.float32)
    nxt = tl.load(base + offs, eviction_policy="evict_first")
    for i in range(ITERS):
        cur = nxt
        ok = i + 1 < ITERS
        nxt = tl.load(base + (i + 1) * tile + offs, mask=(offs >= 0) & ok, other=0.0,
                      eviction_policy="evict_first")
        acc += tl.sum(cur.to(tl.float32), axis=2)
    tl.store(out_ptr + p, tl.sum(tl.sum(acc, axis=1), axis=0))


@functools.cache
def _kernel():
    return jit_functions(__name__, (_read_kernel,))["_read_kernel"]


def read_all(src: torch.Tensor, out: torch.Tensor, programs: int, loads: int, num_warps: int) -> None:
    """Launch the read of ``src`` (bf16, ``numel`` a multiple of ``programs`` x tile)."""
    per_prog = src.numel() // programs
    tile = num_warps * 32 * loads * 8
    _kernel()[(programs,)](src, out, ELEMS_PER_PROG=per_prog, LOADS=loads, ITERS=per_prog // tile,
                           NUM_WARPS=num_warps, num_warps=num_warps)


def cell(nbytes: int, programs: int, loads: int, num_warps: int, device: str) -> tuple[int, float]:
    """(bytes actually read, best us per launch) for one configuration."""
    tile = num_warps * 32 * loads * 8
    per_prog = max(tile, nbytes // 2 // programs // tile * tile)
    numel = per_prog * programs
    copies = [torch.ones(numel, dtype=torch.bfloat16, device=device) for _ in range(4)]
    out = torch.empty(programs, dtype=torch.float32, device=device)
    read_all(copies[0], out, programs, loads, num_warps)
    expect = float(per_prog)
    if not torch.allclose(out.cpu(), torch.full((programs,), expect)):
        raise AssertionError(f"read kernel summed {out[:4].tolist()}, expected {expect} a program")
    if not device.startswith("cuda"):
        return numel * 2, float("nan")
    launches = [functools.partial(read_all, c, out, programs, loads, num_warps) for c in copies]
    return numel * 2, time_graph(launches * 5, replays=10)


def gemv_rows(device: str) -> list[tuple[str, float, float]]:
    """(name, MB read, us a launch) of the decode's weight kernels timed the same way as the read
    cells (PDL off: one launch does not overlap the next)."""
    from laguna_dflash.kernels import moe_gemv, pdl, skinny_gemm, staged_gemv

    saved, pdl.USE_PDL = pdl.USE_PDL, False
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        rows = []
        x = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)
        ws = [torch.randn(10304, 2048, device=device, dtype=torch.bfloat16) for _ in range(4)]
        us = time_graph([functools.partial(skinny_gemm.skinny_gemm, x, w) for w in ws])
        rows.append(("Q|K|V|gate skinny GEMM 10304 x 2048", ws[0].numel() * 2 / 1e6, us))
        del ws
        xo = torch.randn(1, 8192, device=device, dtype=torch.bfloat16)
        ws = [torch.randn(2048, 8192, device=device, dtype=torch.bfloat16) for _ in range(4)]
        us = time_graph([functools.partial(staged_gemv.staged_gemv, xo, w) for w in ws])
        rows.append(("o_proj staged GEMV 2048 x 8192", ws[0].numel() * 2 / 1e6, us))
        del ws
        gate_up = torch.randn(257, 1024, 2048, device=device, dtype=torch.bfloat16) * 0.02
        down = torch.randn(257, 2048, 512, device=device, dtype=torch.bfloat16) * 0.02
        id_sets = [torch.cat([torch.randperm(256, generator=g)[:8], torch.tensor([256])]).view(1, 9).to(device)
                   for _ in range(4)]
        w9 = torch.full((1, 9), 0.1, device=device, dtype=torch.bfloat16)
        us = time_graph([functools.partial(moe_gemv.moe_gemv_experts, x, ids, w9, gate_up, down)
                            for ids in id_sets])
        rows.append(("MoE gate_up + down GEMVs, 9 pairs", 9 * 3 * 512 * 2048 * 2 / 1e6, us))
        return rows
    finally:
        pdl.USE_PDL = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="one small cell (a wiring check)")
    ap.add_argument("--mb", default="19,38,42,400", help="buffer sizes, MB")
    ap.add_argument("--loads", default="1,2,4,8", help="16-byte loads a thread an iteration")
    ap.add_argument("--programs", default="264,528,1056", help="programs a launch")
    ap.add_argument("--gemv", action="store_true", help="also the decode's weight kernels, same timing")
    args = ap.parse_args()
    if args.tiny:
        print(cell(1 << 16, 4, 1, 1, args.device))
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; 4 warps a program; in flight = 2 tiles a program\n")
    print("| MB | programs | loads a thread | KB in flight an SM | us | TB/s |\n|---:|---:|---:|---:|---:|---:|")
    for mb in (float(v) for v in args.mb.split(",")):
        for programs in (int(v) for v in args.programs.split(",")):
            for loads in (int(v) for v in args.loads.split(",")):
                nbytes, us = cell(int(mb * 1e6), programs, loads, 4, args.device)
                in_flight = 2 * 128 * loads * 16 * programs / sms / 1024
                print(f"| {nbytes / 1e6:.1f} | {programs} | {loads} | {in_flight:.0f} | {us:.2f} | "
                      f"{nbytes / us / 1e6:.2f} |")
    if args.gemv:
        print("\n| kernel (PDL off) | MB | us | TB/s |\n|---|---:|---:|---:|")
        for name, mb, us in gemv_rows(args.device):
            print(f"| {name} | {mb:.1f} | {us:.2f} | {mb / us:.2f} |")


if __name__ == "__main__":
    main()
