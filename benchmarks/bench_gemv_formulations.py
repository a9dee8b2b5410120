"""Does a batch-1 GEMV get closer to the copy bandwidth with fewer accumulator registers and more
bytes in flight? A standalone A/B of two GEMV formulations on the decode shapes (bf16, M = 1).

* **baseline**: ``kernels/skinny_gemm.py`` with its measured config: one fp32 accumulator per
  weight element of the ``[BLOCK_N, BLOCK_K]`` tile (32 registers a thread at 16 x 256 / 128
  threads), loads one K step ahead.
* **vec-acc** (this script's kernel): the tile as ``[BLOCK_N, BLOCK_K / VEC, VEC]`` with x loaded
  in the same shape, so each thread's ``VEC`` contiguous elements (one 16-byte load) are summed
  in registers every step (no shuffle, no shared memory: checked on the sm_90 PTX by
  ``tests/test_bench_gemv_formulations.py``) and the accumulator is ``1 / VEC`` the size. The
  freed registers carry ``DEPTH`` (1..3) K steps of loads in flight.

The ninth and tenth passes (docs/PERFORMANCE.md) found that loading two steps ahead in the
current formulation was slower in the decode graph, but it also raised the registers (96 -> 120,
70 -> 127) past one wave of resident programs; this separates the two effects.

Each variant is timed as one CUDA graph of launches cycling through copies of W totalling
>= 256 MiB (W from HBM, not L2), best of 3 x 20 replays; TB/s counts W's bytes. The outputs are
checked against an fp32 reference first.

    python benchmarks/bench_gemv_formulations.py
    TRITON_INTERPRET=1 python benchmarks/bench_gemv_formulations.py --device cpu --tiny  # wiring
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels import skinny_gemm as sg  # noqa: E402
from laguna_dflash.kernels.jit import jit_functions  # noqa: E402

if TYPE_CHECKING:
    import triton.language as tl

SHAPES = [("qkvg", 10240, 2048), ("9 experts' gate_up", 9216, 2048), ("o_proj", 2048, 8192)]
TINY_SHAPES = [("tiny", 48, 256)]
# (BLOCK_N, BLOCK_K, DEPTH, num_warps) of the vec-acc kernel
VARIANTS = [(16, 256, 1, 4), (16, 256, 2, 4), (8, 256, 1, 4), (8, 256, 2, 4), (8, 256, 3, 4),
            (4, 256, 2, 4), (4, 256, 3, 4), (8, 512, 2, 8)]
TINY_VARIANTS = [(16, 64, 1, 2), (8, 64, 2, 2), (8, 32, 3, 2)]
VEC = 8  # bf16 elements of one 16-byte load
ROTATE_BYTES = 256 * 2**20


def _tile(w_rows, x_rows, k0, ok):
    # the weight tile and x (in the weight tile's shape) at column k0; ok = False masks them off
    w = tl.load(w_rows + k0, mask=ok, other=0.0, eviction_policy="evict_first")
    return w, tl.load(x_rows + k0, mask=ok, other=0.0)


def _gemv_vec_acc_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, VEC: tl.constexpr, DEPTH: tl.constexpr,
                         K_ITERS: tl.constexpr):
    # program j: y[j BLOCK_N ..] = W[j BLOCK_N .., :] x, with K % BLOCK_K == 0 and N % BLOCK_N == 0
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = (tl.arange(0, BLOCK_K // VEC)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]
          + n[:, None, None] * 0)
    w_rows = w_ptr + n[:, None, None].to(tl.int64) * K + kk
    x_rows = x_ptr + kk
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    w1, x1 = _tile(w_rows, x_rows, 0, True)
    if DEPTH >= 2:
        w2, x2 = _tile(w_rows, x_rows, BLOCK_K, K_ITERS > 1)
    if DEPTH >= 3:
        w3, x3 = _tile(w_rows, x_rows, 2 * BLOCK_K, K_ITERS > 2)
    for i in range(K_ITERS):
        cw, cx = w1, x1
        if DEPTH == 1:
            w1, x1 = _tile(w_rows, x_rows, (i + 1) * BLOCK_K, i + 1 < K_ITERS)
        elif DEPTH == 2:
            w1, x1 = w2, x2
            w2, x2 = _tile(w_rows, x_rows, (i + 2) * BLOCK_K, i + 2 < K_ITERS)
        else:
            w1, x1, w2, x2 = w2, x2, w3, x3
            w3, x3 = _tile(w_rows, x_rows, (i + 3) * BLOCK_K, i + 3 < K_ITERS)
        # VEC products of one thread's 16-byte load summed in registers, then into acc
        acc += tl.sum(cw.to(tl.float32) * cx.to(tl.float32), axis=2)
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


@functools.lru_cache(maxsize=2)
def kernel(interpret: bool):
    """The JIT kernel (``interpret`` is the cache key; triton reads the environment)."""
    del interpret
    return jit_functions(__name__, (_tile, _gemv_vec_acc_kernel))["_gemv_vec_acc_kernel"]


def gemv_vec_acc(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, depth: int,
                 num_warps: int) -> torch.Tensor:
    """``x [1, K] @ w[N, K]^T -> [1, N]`` (bf16 / fp32) with the vec-acc kernel."""
    n, k = w.shape
    if k % block_k or n % block_n or x.shape != (1, k):
        raise ValueError(f"shape {n}x{k} needs K % {block_k} == 0, N % {block_n} == 0 and x [1, K]")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    kernel(x.device.type == "cpu")[(n // block_n,)](
        x, w, y, n, K=k, BLOCK_N=block_n, BLOCK_K=block_k, VEC=VEC, DEPTH=depth,
        K_ITERS=k // block_k, num_warps=num_warps)
    return y


def time_graph(fns: list, reps: int = 20) -> float:
    """Microseconds a call: one CUDA graph of every fn (one per weight copy), best of 3."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return time_replays(graph, len(fns), reps)


def time_replays(graph: torch.cuda.CUDAGraph, calls: int, reps: int = 20) -> float:
    """Microseconds a call of a captured ``graph`` holding ``calls`` calls: best of 3 x ``reps``
    replays."""
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * calls))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (interpreter wiring check)")
    args = ap.parse_args()
    on_gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes, variants = (TINY_SHAPES, TINY_VARIANTS) if args.tiny else (SHAPES, VARIANTS)
    print("| shape | variant | us | TB/s | x baseline | max rel err |")
    print("|---|---|---:|---:|---:|---:|")
    for name, n, k in shapes:
        copies = max(1, -(-ROTATE_BYTES // (n * k * 2))) if on_gpu else 1
        gen = torch.Generator(device="cpu").manual_seed(n + k)
        ws = [torch.randn(n, k, generator=gen).to(args.device, dtype) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, generator=gen).to(args.device, dtype)
        want = (x.double() @ ws[0].double().T).float()

        rows = [("baseline (skinny_gemm default)", sg.skinny_gemm, ())]
        if n % 8 == 0 and not args.tiny:  # the GEMV MoE's gate_up tile and loop, as a GEMM
            rows.append(("baseline, the MoE GEMV's tile 8x256, 4 warps", sg.skinny_gemm,
                         (sg.SkinnyConfig(8, 256, 1, 4, 2, use_dot=False, x_bcast=True),)))
        rows += [(f"vec-acc {bn}x{bk} depth {d}, {nw} warps", gemv_vec_acc, (bn, bk, d, nw))
                 for bn, bk, d, nw in variants]
        base = None
        for label, fn, extra in rows:
            y = fn(x, ws[0], *extra).float()
            e = ((y - want).abs().max() / want.abs().max()).item()
            if e > 2e-2:
                print(f"| {name} | {label} | wrong (max rel err {e:.3g}) | | | |")
                continue
            if not on_gpu:
                print(f"| {name} | {label} | - | - | - | {e:.2e} |")
                continue
            us = time_graph([functools.partial(fn, x, w, *extra) for w in ws])
            base = base or us
            print(f"| {name} {n}x{k} | {label} | {us:.2f} | {n * k * 2 / us / 1e6:.2f} | "
                  f"{base / us:.3f} | {e:.2e} |", flush=True)


if __name__ == "__main__":
    main()
