"""Routed experts of ONE token (batch-1 decode) as per-pair GEMVs: two Triton launches.

Same math and layout as ``kernels/fused_moe.py`` (``gate_up [E, 2I, H]`` rows gate then up,
``down [E, H, I]``), for ``T`` tokens routed to ``k`` experts each, ``P = T k`` pairs::

    h[p]         = silu(x[t] Wg_e^T) * (x[t] Wu_e^T)      e = ids[p], t = p // k   (fp32, rounded once)
    out[t, j, :] = w[p] * (h[p] Wd_e^T)                    p = t k + j              (fp32, rounded once)

Why a second kernel pair: ``fused_moe`` groups the pairs that share an expert and multiplies
with ``tl.dot`` on 16-row tiles, which verify batches need; at ONE token every pair has its own
expert (top-k ids are distinct, the folded shared expert has id ``E``), there is nothing to
group, and the H200 profile shows those kernels at 2.1-2.75 TB/s (docs/PERFORMANCE.md). Here each
program is a GEMV in the layout of ``kernels/skinny_gemm.py``'s M = 1 path (its fastest on the
H200): one fp32 accumulator per weight element in the weight tile's register layout, the x slice
loaded in the same shape (stride 0 along the rows: no shared memory, no barrier in the loop), the
next tile's loads issued before this tile's FMAs, weights loaded ``evict_first``, and the K
reduction once after the loop.

* ``_gate_up_gemv_kernel``: grid ``(P, ceil(I / BLOCK_N))``; program ``(p, j)`` streams the gate rows
  ``j BLOCK_N ..`` and the matching up rows ``I + j BLOCK_N ..`` of expert ``ids[p]`` over ``H``
  and stores ``h[p, j BLOCK_N ..] = silu(g) * u`` (SwiGLU in the epilogue).
* ``_down_gemv_kernel``: grid ``(P, ceil(H / BLOCK_N))``; program ``(p, j)`` streams down rows
  ``j BLOCK_N ..`` of expert ``ids[p]`` over ``I`` against ``h[p]`` and stores ``w[p]`` times the
  result into ``out[p]``.

Skipped pairs (``has_skipped_pairs``, expert parallelism: an id of ``-1`` is a pair whose expert
is on another rank): the ``SKIP_NEGATIVE`` build's gate_up program returns at once, its down
program stores zeros after its wait; neither reads a weight tile of it. The default build has
no such check (the constexpr compiles it out).

Correct for any ``T`` (pairs that share an expert read its weights once each, so for ``T > 1``
``fused_moe`` is the better choice). Grids depend only on ``P`` and the shapes (CUDA-graph
capturable, no host sync); loop trip counts are compile-time constants (the CPU interpreter
cannot loop to a runtime bound). With ``kernels.pdl.USE_PDL`` (on by default) both kernels
use programmatic dependent launch; the down kernel reads its expert ids and first weight tile
before it waits for gate_up's ``h`` (kernels/pdl.py). On the H200 at Laguna-XS-2.1 shapes (9 pairs per token: top-8
plus the folded shared expert) one layer's experts take 19.8 / 36.4 / 57.3 us at T = 1 / 2 / 4
against 30.5 / 45.9 / 71.4 us for ``fused_moe`` (CUDA-graph replays; floors 13.3 / 26.5 / 50.1
us; docs/PERFORMANCE.md): at these sizes few pairs share an expert, so ``MoE`` takes this path
up to ``MoE.moe_gemv_max_tokens`` = 4 tokens (``MoE.use_moe_gemv``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import pdl
from .availability import interpret_mode, triton_can_run
from .jit import DTYPE_CODE, _round_to, jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["GATE_UP_CONFIG", "DOWN_CONFIG", "is_available", "moe_gemv_experts"]

# (BLOCK_N, BLOCK_K, num_warps) per kernel: the best of 36 pairs swept on the H200 at XS-2.1
# shapes, H = 2048, I = 512 (bench_fused_moe.py --tokens 1 --sweep: 19.8 us per layer; the
# next five within 4%).
GATE_UP_CONFIG = (8, 256, 4)
DOWN_CONFIG = (32, 128, 4)


def is_available(device: torch.device | str) -> bool:
    """Triton importable and a CUDA device, or a CPU under ``TRITON_INTERPRET=1``."""
    return triton_can_run(device)


def _tile_w(w_rows, k0, ok, offs_n, N, K, BLOCK_K: tl.constexpr):
    # weight tile [BLOCK_N, BLOCK_K] at column k0; ok = False masks it (the prefetch past the end)
    offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    return tl.load(w_rows + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K) & ok,
                   other=0.0, eviction_policy="evict_first")


def _tile_x(x_row, k0, ok, zero_n, K, BLOCK_K: tl.constexpr):
    # the x slice at column k0 in the weight tile's shape (stride 0 along n)
    offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    kk = offs_k[None, :] + zero_n
    return tl.load(x_row + kk, mask=(kk < K) & ok, other=0.0)


def _tile_gemv(w_rows, x_row, k0, ok, offs_n, zero_n, N, K, BLOCK_K: tl.constexpr):
    # weight tile and x slice at column k0 (see _tile_w, _tile_x)
    return _tile_w(w_rows, k0, ok, offs_n, N, K, BLOCK_K), _tile_x(x_row, k0, ok, zero_n, K, BLOCK_K)


def _gate_up_gemv_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr,
    K_TOP: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr, SKIP_NEGATIVE: tl.constexpr,
):
    p = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the ids are the previous kernel's (routing) output
    expert = tl.load(ids_ptr + p).to(tl.int64)
    if SKIP_NEGATIVE:
        # a skipped pair (id -1): its h row stays unwritten, and the down kernel never reads it
        if expert < 0:
            return
    x_row = x_ptr + (p // K_TOP).to(tl.int64) * H
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    zero_n = offs_n[:, None] * 0
    base = w_ptr + expert * (2 * INTER * H)
    g_rows = base + offs_n[:, None].to(tl.int64) * H
    u_rows = g_rows + INTER * H
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    wg, xs = _tile_gemv(g_rows, x_row, 0, True, offs_n, zero_n, INTER, H, BLOCK_K)
    wu, _ = _tile_gemv(u_rows, x_row, 0, True, offs_n, zero_n, INTER, H, BLOCK_K)
    for i in range(K_ITERS):
        cg, cu, cx = wg, wu, xs
        ok = i + 1 < K_ITERS
        wg, xs = _tile_gemv(g_rows, x_row, (i + 1) * BLOCK_K, ok, offs_n, zero_n, INTER, H, BLOCK_K)
        wu, _ = _tile_gemv(u_rows, x_row, (i + 1) * BLOCK_K, ok, offs_n, zero_n, INTER, H, BLOCK_K)
        xf = cx.to(tl.float32)
        acc_g += cg.to(tl.float32) * xf
        acc_u += cu.to(tl.float32) * xf
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(g) * u  # silu(g) * u, fp32, rounded once (as fused_moe)
    tl.store(h_ptr + p.to(tl.int64) * INTER + offs_n, _round_to(h, OUT_DTYPE).to(h_ptr.dtype.element_ty),
             mask=offs_n < INTER)


def _down_gemv_kernel(
    h_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr, SKIP_NEGATIVE: tl.constexpr,
):
    p = tl.program_id(0)
    if PDL:
        # launched while gate_up may still run, but after every gate_up program passed its wait:
        # the routing kernel's ids are complete; read them through L2 (kernels/pdl.py, rule 3)
        expert = tl.load(ids_ptr + p, cache_modifier=".cg").to(tl.int64)
    else:
        expert = tl.load(ids_ptr + p).to(tl.int64)
    h_row = h_ptr + p.to(tl.int64) * INTER
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    zero_n = offs_n[:, None] * 0
    rows = w_ptr + expert * (H * INTER) + offs_n[:, None].to(tl.int64) * INTER
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SKIP_NEGATIVE:
        # a skipped pair (id -1) masks off its first weight tile: no read below w_ptr
        w = _tile_w(rows, 0, expert >= 0, offs_n, H, INTER, BLOCK_K)
    else:
        w = _tile_w(rows, 0, True, offs_n, H, INTER, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()  # h is gate_up's output
    if SKIP_NEGATIVE:
        # ... and stores exact zeros, after the one wait every program makes (kernels/pdl.py,
        # rule 1: the kernel completes after gate_up even when every pair is skipped), reading
        # no h row (gate_up left it unwritten) and no more weights
        if expert < 0:
            tl.store(out_ptr + p.to(tl.int64) * H + offs_n,
                     tl.zeros([BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=offs_n < H)
            return
    hs = _tile_x(h_row, 0, True, zero_n, INTER, BLOCK_K)
    for i in range(K_ITERS):
        cw, ch = w, hs
        w, hs = _tile_gemv(rows, h_row, (i + 1) * BLOCK_K, i + 1 < K_ITERS, offs_n, zero_n, H, INTER,
                           BLOCK_K)
        acc += cw.to(tl.float32) * ch.to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(acc, axis=1) * tl.load(rw_ptr + p).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * H + offs_n, _round_to(out, OUT_DTYPE).to(out_ptr.dtype.element_ty),
             mask=offs_n < H)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """(gate_up kernel, down kernel) for one mode (``interpret`` is the cache key)."""
    del interpret
    ns = jit_functions(__name__, (_round_to, _tile_w, _tile_x, _tile_gemv, _gate_up_gemv_kernel,
                                  _down_gemv_kernel))
    return ns["_gate_up_gemv_kernel"], ns["_down_gemv_kernel"]


def moe_gemv_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    has_skipped_pairs: bool = False,
) -> torch.Tensor:
    """Each (token, expert) pair's weighted expert output ``[T, k, H]`` in ``x.dtype``.

    Args:
        x: ``[T, H]`` fp32 / bf16 / fp16 (meant for ``T = 1``; correct for any ``T``).
        expert_ids: ``[T, k]`` integer expert ids in ``[0, E)`` (any integer dtype); with
            ``has_skipped_pairs`` also ``-1``. Not range-checked (that would sync the host).
        weights: ``[T, k]`` routing weights (any float dtype; used in fp32).
        gate_up: ``[E, 2I, H]`` contiguous, x's dtype.
        down: ``[E, H, I]`` contiguous, x's dtype.
        has_skipped_pairs: ``expert_ids`` may hold ``-1``, a *skipped pair* (expert parallelism:
            the pair's expert lives on another rank): its output row is exactly zero and no
            expert weight is read for it. Every other pair's row is bitwise the one the same call
            gives it with no pair skipped (pairs are independent here). ``False`` compiles the
            kernels without the check (the tuned default).

    Returns:
        ``[T, k, H]``: pair ``(t, j)`` is ``w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)``, the
        contract of ``fused_moe.fused_moe_experts(..., reduce=False)``; zeros for skipped pairs.
    """
    t, k = expert_ids.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    if x.shape != (t, hidden) or down.shape != (e, hidden, inter):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, expert_ids {tuple(expert_ids.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if not (x.dtype == gate_up.dtype == down.dtype) or x.dtype not in DTYPE_CODE:
        raise ValueError(f"x, gate_up and down must share one of fp32 / bf16 / fp16, got "
                         f"{x.dtype}, {gate_up.dtype}, {down.dtype}")
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("gate_up and down must be contiguous (the kernels address them by shape)")
    p = t * k
    out = torch.empty((t, k, hidden), dtype=x.dtype, device=x.device)
    if p == 0:
        return out
    x = x.contiguous()
    ids = expert_ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    h = torch.empty((p, inter), dtype=x.dtype, device=x.device)
    interpret = interpret_mode()
    gate_up_kernel, down_kernel = _kernels(interpret)
    code = DTYPE_CODE[x.dtype]
    use_pdl = pdl.active(x.device, interpret)
    bn, bk, nw = GATE_UP_CONFIG
    gate_up_kernel[(p, -(-inter // bn))](
        x, gate_up, ids, h, K_TOP=k, H=hidden, INTER=inter, BLOCK_N=bn, BLOCK_K=bk,
        K_ITERS=-(-hidden // bk), OUT_DTYPE=code, PDL=use_pdl, SKIP_NEGATIVE=bool(has_skipped_pairs),
        num_warps=nw, **pdl.launch_options(use_pdl))
    bn, bk, nw = DOWN_CONFIG
    down_kernel[(p, -(-hidden // bn))](
        h, down, ids, rw, out, H=hidden, INTER=inter, BLOCK_N=bn, BLOCK_K=bk,
        K_ITERS=-(-inter // bk), OUT_DTYPE=code, PDL=use_pdl, SKIP_NEGATIVE=bool(has_skipped_pairs),
        num_warps=nw, **pdl.launch_options(use_pdl))
    return out
