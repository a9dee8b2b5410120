"""How much of a batch-1 GEMV hides behind a latency-bound kernel before it? The staged GEMV
(kernels/staged_gemv.py: weight parked in shared memory before the PDL wait) against the skinny
GEMM (kernels/skinny_gemm.py), standalone.

In the decode graph the GEMV after a latency-bound kernel (o_proj after attention and the split
merge) is launched early with PDL and may load weights before its wait. This emulates that
window: a one-program "busy" kernel that signals its dependents, then spins for ``W`` us (the
HBM idle), then writes x; the GEMV follows with PDL. The pair is timed in a CUDA graph that
cycles through copies of the weight (> L2), best of 3; the table gives us per pair minus W, i.e.
what the GEMV costs past the window. Values are checked against an fp64 reference first.

    python benchmarks/bench_staged_gemv.py                # o_proj 2048 x 8192, bf16, H200
    python benchmarks/bench_staged_gemv.py --windows 0,4
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv_formulations import time_graph  # noqa: E402

from laguna_dflash.kernels import skinny_gemm as sg  # noqa: E402
from laguna_dflash.kernels import staged_gemv as stg  # noqa: E402

ROTATE_BYTES = 256 * 2**20
# (block_n, stage_k, stages, num_warps)
CONFIGS = [(8, 512, 8, 4), (8, 512, 12, 4), (8, 1024, 4, 4), (16, 512, 6, 8), (8, 512, 4, 4)]


def config_label(c: tuple) -> str:
    cfg = stg.StagedConfig(*c)
    return f"staged {cfg.block_n}x{cfg.stage_k}, {cfg.stages} parked, {cfg.num_warps} warps"


@functools.cache
def _busy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def busy(x_ptr, K, ns, BLOCK: tl.constexpr):
        # signal first (the next kernel may start loading its weight), then hold the GPU for ns
        # nanoseconds after the previous kernel, then write x (what the next kernel waits for)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        t0 = tl.extra.cuda.globaltimer()
        t = t0
        while t - t0 < ns:
            t = tl.extra.cuda.globaltimer()
        offs = tl.arange(0, BLOCK)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_ptr + k0 + offs, mask=k0 + offs < K)
            tl.store(x_ptr + k0 + offs, v, mask=k0 + offs < K)

    return busy


def busy(x: torch.Tensor, window_us: float) -> None:
    """The window: one program, PDL, spins ``window_us`` then rewrites x in place."""
    _busy_kernel()[(1,)](x, x.numel(), int(window_us * 1000), BLOCK=1024, num_warps=4, launch_pdl=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2048x8192", help="N x K of the weight")
    ap.add_argument("--windows", default="0,2,4,8", help="busy-kernel durations, us")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    windows = [float(v) for v in args.windows.split(",")]
    copies = max(1, -(-ROTATE_BYTES // (n * k * 2)))
    gen = torch.Generator(device="cpu").manual_seed(0)
    ws = [(torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, generator=gen).to("cuda", torch.bfloat16)
    want = (x.double() @ ws[0].double().T).float()
    ulp = want.abs() * 2.0**-7 + 1e-3

    rows = [("skinny_gemm default", sg.skinny_gemm, ())]
    rows += [(config_label(c), stg.staged_gemv, (stg.StagedConfig(*c),)) for c in CONFIGS]
    print(f"weight {n}x{k} bf16, {copies} copies; us per (busy + GEMV) minus the window")
    print("| GEMV | " + " | ".join(f"W={w:g} us" for w in windows) + " | max err / ulp | smem KiB |")
    print("|---|" + "---:|" * (len(windows) + 2))
    for label, fn, extra in rows:
        try:
            y = fn(x, ws[0], *extra).float()
            y2 = fn(x, ws[0], *extra).float()
        except Exception as e:  # noqa: BLE001 - one failing config must not lose the others
            print(f"| {label} | failed: {type(e).__name__}: {str(e)[:120]} |")
            continue
        err = ((y - want).abs() / ulp).max().item()
        if err > 1.0 or not torch.equal(y, y2):
            print(f"| {label} | wrong: err {err:.3g} ulp, deterministic {torch.equal(y, y2)} |")
            continue
        cells = []
        for w_us in windows:
            fns = []
            for w in ws:
                fns.append(functools.partial(busy, x, w_us))
                fns.append(functools.partial(fn, x, w, *extra))
            us = time_graph(fns) * 2 - w_us  # time_graph divides by the launches (2 a pair)
            cells.append(f"{us:.2f}")
        smem = extra[0].smem_bytes(k) / 1024 if extra else 0
        print(f"| {label} | " + " | ".join(cells) + f" | {err:.2f} | {smem:.0f} |", flush=True)


if __name__ == "__main__":
    main()
