"""Can a batch-1 GEMV park its weight in shared memory during *several* kernels before it?

The thirteenth pass parks o_proj's weight before its PDL wait (kernels/staged_gemv.py); PDL
makes a kernel resident only during the one kernel before it. The next layer's Q|K|V|gate GEMV
(42 MB at Laguna-XS-2.1) could instead be launched on a side stream of the CUDA graph while the
routing and the MoE run, park what shared memory holds, and spin on a flag until its input is
written. This prototype measures that idea alone, before any engine work:

* the GEMV is persistent (one program an SM at most, so the kernels of the main stream keep their
  room and cannot be starved into a deadlock): program ``p`` owns row blocks ``p, p + G, ...``,
  walked as items ``[BLOCK_N, STAGE_K]``; it parks its first ``PARK`` items, then spins (acquire)
  on a flag until it reaches this replay's epoch, loads x, uses the parked items and streams the
  rest four items ahead. The spin gives up after ``--timeout-us`` and raises an error flag (the
  table then says so) instead of hanging a machine when the graph serialised the two streams;
* the main stream emulates what runs meanwhile: a one-program kernel that spins ``W`` us (HBM
  idle: the routing, the norms), optionally a read of ``--compete-mb`` MB (the MoE's expert
  weights, which share the HBM), then writes x and releases the flag;
* baselines in the same run and graph shape: the same main-stream chain followed by the skinny GEMM
  (kernels/skinny_gemm.py) and by the staged GEMV (its PDL wait covers only the last window).

us per pair minus the chain's own time measured alone (so: what the GEMV costs past the window).
Values are checked against an fp64 reference first, bitwise repeatable.

Measured on the H200 (docs/PERFORMANCE.md, seventeenth pass): slower than the PDL staged GEMV in
every cell, slower than the skinny GEMM whenever the window holds another weight stream, and the
spin timed out (the main stream starved) in 4 of 18 cells. The idea is ruled out in this form.

    python benchmarks/bench_parked_gemv.py                      # Q|K|V|gate 10304 x 2048, H200
    python benchmarks/bench_parked_gemv.py --windows 0,4,8 --compete-mb 0,57
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv_formulations import time_replays  # noqa: E402

from laguna_dflash.kernels import skinny_gemm as sg  # noqa: E402
from laguna_dflash.kernels import staged_gemv as stg  # noqa: E402

ROTATE_BYTES = 256 * 2**20
_SMEM_BUDGET = 200 * 1024  # parked items + x, of the 227 KiB a program may have on sm_90
# (block_n, stage_k, num_warps)
CONFIGS = [(8, 512, 4), (16, 512, 8), (8, 256, 4)]


@functools.cache
def parked_kernel():
    """The persistent parked GEMV (module docstring), a Gluon kernel."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _item_load(w_ptr, n, p, i, r_off, cols, K: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGE_K: gl.constexpr, NUM_K: gl.constexpr, GRID: gl.constexpr, ITEMS: gl.constexpr, like):
        # item i of program p: row block p + (i // NUM_K) GRID, stage i % NUM_K (rows past N and
        # items past ITEMS read nothing)
        if i < ITEMS:
            rows = (p + (i // NUM_K) * GRID) * BLOCK_N + r_off
            v = gl.load(w_ptr + rows[:, None].to(gl.int64) * K + (i % NUM_K) * STAGE_K + cols[None, :],
                        mask=rows[:, None] < n, other=0.0, eviction_policy="evict_first")
        else:
            v = gl.zeros_like(like)
        return v

    @gluon.jit
    def _parked_gemv_kernel(
        w_ptr, x_ptr, y_ptr, flag_ptr, epoch_ptr, err_ptr, n, timeout_ns,
        K: gl.constexpr, BLOCK_N: gl.constexpr, STAGE_K: gl.constexpr, NUM_K: gl.constexpr,
        GRID: gl.constexpr, ITEMS: gl.constexpr, PARK: gl.constexpr, X_ROWS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        p = gl.program_id(0)
        w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        r_off = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
        cols = gl.arange(0, STAGE_K, layout=gl.SliceLayout(0, w_layout))
        like = gl.zeros([BLOCK_N, STAGE_K], w_ptr.dtype.element_ty, w_layout)
        parked = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [PARK, BLOCK_N, STAGE_K], flat)
        q0 = _item_load(w_ptr, n, p, 0, r_off, cols, K, BLOCK_N, STAGE_K, NUM_K, GRID, ITEMS, like)
        q1 = _item_load(w_ptr, n, p, 1, r_off, cols, K, BLOCK_N, STAGE_K, NUM_K, GRID, ITEMS, like)
        q2 = _item_load(w_ptr, n, p, 2, r_off, cols, K, BLOCK_N, STAGE_K, NUM_K, GRID, ITEMS, like)
        q3 = _item_load(w_ptr, n, p, 3, r_off, cols, K, BLOCK_N, STAGE_K, NUM_K, GRID, ITEMS, like)
        for i in gl.static_range(PARK):  # the weight is never written: parked before the flag
            w = q0
            q0 = q1
            q1 = q2
            q2 = q3
            q3 = _item_load(w_ptr, n, p, i + 4, r_off, cols, K, BLOCK_N, STAGE_K, NUM_K, GRID, ITEMS, like)
            parked.index(i).store(w)
        # x is written by a kernel of another stream: spin (acquire, GPU scope) until the flag
        # reaches this replay's epoch, or give up after timeout_ns and flag the error
        epoch = gl.load(epoch_ptr)
        t0 = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                       is_pure=False, pack=1)
        seen = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        waited = t0 - t0
        while (seen < epoch) & (waited < timeout_ns):
            seen = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            waited = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                               is_pure=False, pack=1) - t0
        if seen < epoch:
            gl.atomic_add(err_ptr, 1)
        gl.thread_barrier()
        xr = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, w_layout))
        xv = gl.load(x_ptr + xr[:, None] * STAGE_K + cols[None, :], mask=xr[:, None] < NUM_K, other=0.0)
        xs = gl.allocate_shared_memory(xv.dtype, [X_ROWS, STAGE_K], flat, xv)
        gl.thread_barrier()
        acc = gl.zeros([BLOCK_N, STAGE_K], gl.float32, w_layout)
        for i in gl.static_range(ITEMS):
            if i < PARK:
                wf = parked.index(i).load(w_layout).to(gl.float32)
            else:
                w = q0
                q0 = q1
                q1 = q2
                q2 = q3
                q3 = _item_load(w_ptr, n, p, i + 4, r_off, cols, K, BLOCK_N, STAGE_K, NUM_K, GRID, ITEMS, like)
                wf = w.to(gl.float32)
            acc += wf * xs.slice(i % NUM_K, 1).load(w_layout).to(gl.float32)
            if i % NUM_K == NUM_K - 1:  # the row block's last stage: reduce over K, store
                rows = (p + (i // NUM_K) * GRID) * BLOCK_N + r_off
                gl.store(y_ptr + rows, gl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < n)
                acc = gl.zeros([BLOCK_N, STAGE_K], gl.float32, w_layout)

    return _parked_gemv_kernel


def parked_plan(n: int, k: int, cfg: tuple[int, int, int], num_sms: int) -> dict:
    """Grid and items of one config: ``G = min(SMs, row blocks)`` programs, ``ITEMS`` items each,
    ``PARK`` of them parked (what ``_SMEM_BUDGET`` holds next to x)."""
    block_n, stage_k, num_warps = cfg
    num_k = k // stage_k
    row_blocks = -(-n // block_n)
    grid = min(num_sms, row_blocks)
    items = -(-row_blocks // grid) * num_k
    x_rows = 1 << max(0, num_k - 1).bit_length()
    item_bytes = block_n * stage_k * 2
    park = max(1, min(items, (_SMEM_BUDGET - x_rows * stage_k * 2) // item_bytes))
    return dict(K=k, BLOCK_N=block_n, STAGE_K=stage_k, NUM_K=num_k, GRID=grid, ITEMS=items, PARK=park,
                X_ROWS=x_rows, num_warps=num_warps)


def parked_gemv(x, w, y, flag, epoch, err, plan: dict, timeout_us: float) -> None:
    """Launch the parked GEMV: ``y [N] = w [N, K] @ x [K]`` once ``flag >= epoch``."""
    parked_kernel()[(plan["GRID"],)](w, x, y, flag, epoch, err, w.shape[0], int(timeout_us * 1000), **plan)


@functools.cache
def _chain_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def bump(epoch_ptr):
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)

    @triton.jit
    def busy_write_release(x_ptr, src_ptr, K, ns, flag_ptr, epoch_ptr, BLOCK: tl.constexpr):
        # PDL: let the next kernel of this stream (the baselines' GEMV) start loading its weight,
        # hold the GPU ns nanoseconds (HBM idle), write x, then release this replay's epoch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        t0 = tl.extra.cuda.globaltimer()
        t = t0
        while t - t0 < ns:
            t = tl.extra.cuda.globaltimer()
        offs = tl.arange(0, BLOCK)
        for k0 in range(0, K, BLOCK):
            tl.store(x_ptr + k0 + offs, tl.load(src_ptr + k0 + offs, mask=k0 + offs < K), mask=k0 + offs < K)
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr, tl.load(epoch_ptr), sem="release", scope="gpu")

    @triton.jit
    def read_sum(src_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        # a weight stream that shares the HBM (the MoE's experts): each program sums its chunk
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_first")
        tl.store(out_ptr + tl.program_id(0), tl.sum(v.to(tl.float32), 0))

    return bump, busy_write_release, read_sum


class Chain:
    """The main stream's work before the GEMV: spin ``window_us`` us, read ``compete`` (a bf16
    buffer, or None), then write x and release the flag."""

    def __init__(self, x, src, flag, epoch, window_us: float, compete: torch.Tensor | None):
        self.x, self.src, self.flag, self.epoch, self.window_us, self.compete = x, src, flag, epoch, window_us, compete
        self.sums = None if compete is None else torch.empty(-(-compete.numel() // 8192), device=x.device)

    def __call__(self) -> None:
        _, busy_write_release, read_sum = _chain_kernels()
        if self.compete is not None:
            read_sum[(self.sums.numel(),)](self.compete, self.sums, self.compete.numel(), BLOCK=8192, num_warps=8)
        busy_write_release[(1,)](self.x, self.src, self.x.numel(), int(self.window_us * 1000), self.flag,
                                 self.epoch, BLOCK=1024, num_warps=4, launch_pdl=True)


def capture(chains: list[Chain], gemv, side: bool, epoch: torch.Tensor) -> torch.cuda.CUDAGraph:
    """One graph: bump the epoch, then per weight copy i either ``chain_i; gemv_i`` on one stream
    (``side`` False) or ``gemv_i`` forked onto a side stream while ``chain_i`` runs, then joined."""
    bump = _chain_kernels()[0]
    side_stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bump[(1,)](epoch)
        main = torch.cuda.current_stream()
        for i, chain in enumerate(chains):
            if side:
                side_stream.wait_stream(main)
                with torch.cuda.stream(side_stream):
                    gemv(i)
                chain()
                main.wait_stream(side_stream)
            else:
                chain()
                if gemv is not None:
                    gemv(i)
    return graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="10304x2048", help="N x K of the weight (Q|K|V|gate at XS-2.1)")
    ap.add_argument("--windows", default="0,4,8", help="HBM-idle spin before x is written, us")
    ap.add_argument("--compete-mb", default="0,57", help="MB read on the main stream in the window")
    ap.add_argument("--timeout-us", type=float, default=2000.0, help="the parked GEMV's spin limit")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device="cpu").manual_seed(0)
    ws = [(torch.randn(n, k, generator=gen) * 0.02).to(dev, torch.bfloat16) for _ in range(copies)]
    src = torch.randn(k, generator=gen).to(dev, torch.bfloat16)
    xs = [torch.zeros(k, device=dev, dtype=torch.bfloat16) for _ in ws]
    ys = [torch.zeros(n, device=dev, dtype=torch.bfloat16) for _ in ws]
    flags = torch.zeros(copies, device=dev, dtype=torch.int32)
    epoch = torch.zeros(1, device=dev, dtype=torch.int32)
    err = torch.zeros(1, device=dev, dtype=torch.int32)
    want = (src.double() @ ws[0].double().T).float()
    ulp = want.abs() * 2.0**-7 + 1e-3
    print(f"weight {n}x{k} bf16, {copies} copies, {num_sms} SMs; us per pair past the chain alone")

    variants = [("skinny_gemm after the chain", False, lambda i: ys[i].copy_(sg.skinny_gemm(xs[i][None], ws[i])[0])),
                ("staged GEMV (PDL) after the chain", False,
                 lambda i: ys[i].copy_(stg.staged_gemv(xs[i][None], ws[i])[0]))]
    for cfg in CONFIGS:
        plan = parked_plan(n, k, cfg, num_sms)
        if k % cfg[1]:
            continue
        label = (f"parked {cfg[0]}x{cfg[1]}, {cfg[2]} warps, side stream ({plan['GRID']} programs, "
                 f"{plan['PARK']}/{plan['ITEMS']} items parked)")
        variants.append((label, True, functools.partial(
            lambda i, plan: parked_gemv(xs[i], ws[i], ys[i], flags[i:i + 1], epoch, err, plan, args.timeout_us),
            plan=plan)))
    windows = [float(v) for v in args.windows.split(",")]
    competes = [float(v) for v in args.compete_mb.split(",")]
    cells = [(w, c) for c in competes for w in windows]
    print("| GEMV | " + " | ".join(f"W={w:g} us, {c:g} MB" for w, c in cells) + " |")
    print("|---|" + "---:|" * len(cells))
    alone = {}
    for w_us, mb in cells:
        # one competing buffer a weight copy (together > L2, as the MoE's experts are)
        per = int(mb * 2**20) // 2
        compete = None if mb == 0 else torch.empty(per * copies, device=dev, dtype=torch.bfloat16).normal_()
        chains = [Chain(x, src, flags[i:i + 1], epoch, w_us, None if compete is None else compete[i * per:(i + 1) * per])
                  for i, x in enumerate(xs)]
        for c in chains:
            c()
        alone[w_us, mb] = (time_replays(capture(chains, None, False, epoch), len(chains)), chains)
    for label, side, gemv in variants:
        row = []
        for w_us, mb in cells:
            base, chains = alone[w_us, mb]
            for y in ys:
                y.zero_()
            err.zero_()
            try:
                graph = capture(chains, gemv, side, epoch)
                graph.replay()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
                row.append(f"failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            y0 = ys[0].float().clone()
            bad = ((y0 - want).abs() / ulp).max().item()
            graph.replay()
            torch.cuda.synchronize()
            if err.item() or bad > 1.0 or not torch.equal(ys[0].float(), y0):
                row.append(f"wrong: err {bad:.3g} ulp, spin timeouts {err.item()}")
                continue
            row.append(f"{time_replays(graph, len(chains)) - base:.2f}")
        print(f"| {label} | " + " | ".join(row) + " |", flush=True)
    print("chain alone, us a pair: " + ", ".join(f"W={w:g}/{c:g} MB {alone[w, c][0]:.2f}" for w, c in cells))


if __name__ == "__main__":
    main()
