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

With ``shared_expert_early`` (``MoE.shared_expert_before_routing``, off until timed) the
gate_up programs of every token's last pair, the folded shared expert, whose id is known
without the routing, compute their GEMV before the PDL wait: while the routing kernel's last
program still routes, the HBM streams the shared expert's 1/9 of the bytes (kernels/pdl.py
rule 3). The same arithmetic, so bitwise the same output.

With ``shared_expert_once`` (``MoE.shared_expert_once``, off until timed) and 2..4 tokens the
folded shared expert's weights are read once instead of once per token: after the
``T (k - 1)`` routed pairs come ``ONCE_ROWS`` (2 or 4) program groups of the shared expert,
whose program ``(j, b)`` takes ``BLOCK_N / ONCE_ROWS`` of block ``b``'s rows for every token
(tile row ``v``: weight row ``j RS + v % RS``, token ``v // RS``). Its tile keeps a pair's shape,
registers and instruction count (only the addresses differ), unlike the removed 4-row groups
(docs/PERFORMANCE.md, ninth pass), so the shared expert costs 1/T of its bytes; the per-row
arithmetic is the same, so bitwise the same output.

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


def _tile_x(x_rows, k0, ok, K, BLOCK_K: tl.constexpr, X_CACHE: tl.constexpr):
    # the x slices at column k0 in the weight tile's shape: x_rows [BLOCK_N, 1] points at each
    # tile row's x (one row for a pair's tile: the redundant lanes hit L1); ok masks (a scalar
    # or per row); X_CACHE: the load's cache modifier ("" or ".cg": through L2 only, for x read
    # before the PDL wait)
    offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    return tl.load(x_rows + offs_k[None, :], mask=(offs_k[None, :] < K) & ok, other=0.0,
                   cache_modifier=X_CACHE)


def _tile_gemv(w_rows, x_rows, k0, ok, x_ok, offs_n, N, K, BLOCK_K: tl.constexpr,
               X_CACHE: tl.constexpr):
    # weight tile and x slices at column k0 (see _tile_w, _tile_x)
    return (_tile_w(w_rows, k0, ok, offs_n, N, K, BLOCK_K),
            _tile_x(x_rows, k0, ok & x_ok, K, BLOCK_K, X_CACHE))


def _routed_pair(i, K_TOP: tl.constexpr):
    # the pair of the i-th routed group when every token's last column is the shared expert
    return (i // (K_TOP - 1)) * K_TOP + i % (K_TOP - 1)


def _store_swiglu(h_ptrs, acc_g, acc_u, mask, OUT_DTYPE: tl.constexpr):
    # h = silu(g) * u of the rows' [BLOCK_N, BLOCK_K] accumulators: fp32, rounded once (as
    # fused_moe)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptrs, _round_to(h, OUT_DTYPE).to(h_ptrs.dtype.element_ty), mask=mask)


def _store_weighted(out_ptrs, total, rw, mask, OUT_DTYPE: tl.constexpr):
    # the rows' fp32 sums times their routing weight (fp32), rounded once
    out = total * rw
    tl.store(out_ptrs, _round_to(out, OUT_DTYPE).to(out_ptrs.dtype.element_ty), mask=mask)


def _program_rows(q, pid_n, K_TOP: tl.constexpr, T_ROWS: tl.constexpr, ONCE_ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    # program (q, pid_n)'s tile rows -> (shared: the folded shared expert's program, n [BLOCK_N]
    # expert rows, tok [BLOCK_N] tokens, pair [BLOCK_N] pairs, p0 the program's routed pair).
    # Without ONCE_ROWS program group q is pair q (shared: its last column). With ONCE_ROWS the
    # T_ROWS (K_TOP - 1) routed pairs come first, then ONCE_ROWS groups of the shared expert:
    # group j's program pid_n takes RS = BLOCK_N / ONCE_ROWS of block pid_n's rows for ONCE_ROWS
    # tokens (tile row v: row j RS + v % RS, token v // RS; tokens >= T_ROWS masked by the
    # caller), so the shared expert's weights are read once for all tokens
    v = tl.arange(0, BLOCK_N)
    if ONCE_ROWS > 0:
        num_routed = T_ROWS * (K_TOP - 1)
        shared = q >= num_routed
        rs = BLOCK_N // ONCE_ROWS
        t = q // (K_TOP - 1)
        p0 = _routed_pair(q, K_TOP)
        n = tl.where(shared, pid_n * BLOCK_N + (q - num_routed) * rs + v % rs, pid_n * BLOCK_N + v)
        tok = tl.where(shared, v // rs, v * 0 + t)
        pair = tl.where(shared, tok * K_TOP + K_TOP - 1, v * 0 + p0)
    else:
        shared = q % K_TOP == K_TOP - 1
        p0 = q
        n = pid_n * BLOCK_N + v
        tok = v * 0 + q // K_TOP
        pair = v * 0 + q
    return shared, n, tok.to(tl.int64), pair.to(tl.int64), p0


def _gate_up_rows(g_rows, u_rows, x_rows, x_ok, offs_n, INTER, H, BLOCK_K: tl.constexpr,
                  K_ITERS: tl.constexpr, X_CACHE: tl.constexpr):
    # the gate and up rows' [BLOCK_N, BLOCK_K] fp32 accumulators over H, the next tile's loads
    # issued before this tile's FMAs
    acc_g = tl.zeros([offs_n.shape[0], BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([offs_n.shape[0], BLOCK_K], dtype=tl.float32)
    wg, xs = _tile_gemv(g_rows, x_rows, 0, True, x_ok, offs_n, INTER, H, BLOCK_K, X_CACHE)
    wu = _tile_w(u_rows, 0, True, offs_n, INTER, H, BLOCK_K)
    for i in range(K_ITERS):
        cg, cu, cx = wg, wu, xs
        ok = i + 1 < K_ITERS
        wg, xs = _tile_gemv(g_rows, x_rows, (i + 1) * BLOCK_K, ok, x_ok, offs_n, INTER, H, BLOCK_K,
                            X_CACHE)
        wu = _tile_w(u_rows, (i + 1) * BLOCK_K, ok, offs_n, INTER, H, BLOCK_K)
        xf = cx.to(tl.float32)
        acc_g += cg.to(tl.float32) * xf
        acc_u += cu.to(tl.float32) * xf
    return acc_g, acc_u


def _expert(ids_ptr, p0, shared, SHARED_ID: tl.constexpr, ONCE_ROWS: tl.constexpr,
            CACHE: tl.constexpr):
    # the program's expert: pair p0's id, or SHARED_ID for the shared expert's once-groups
    if ONCE_ROWS > 0:
        routed = tl.load(ids_ptr + p0, mask=~shared, other=0, cache_modifier=CACHE)
        return tl.where(shared, SHARED_ID, routed).to(tl.int64)
    return tl.load(ids_ptr + p0, cache_modifier=CACHE).to(tl.int64)


def _gate_up_gemv_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr,
    K_TOP: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr, SHARED_ID: tl.constexpr, EARLY: tl.constexpr, T_ROWS: tl.constexpr,
    ONCE_ROWS: tl.constexpr,
):
    # SHARED_ID: the folded shared expert's id (every token's last pair; -1: none); EARLY: its
    # programs compute before the PDL wait (shared_expert_early); ONCE_ROWS: its weights read
    # once for all T_ROWS tokens (shared_expert_once; _program_rows)
    shared, n, tok, pair, p0 = _program_rows(tl.program_id(0), tl.program_id(1), K_TOP, T_ROWS,
                                             ONCE_ROWS, BLOCK_N)
    x_rows = x_ptr + tok[:, None] * H
    x_ok = tok[:, None] < T_ROWS if ONCE_ROWS > 0 else True
    row_offs = n[:, None].to(tl.int64) * H
    if EARLY:
        if shared:
            # a weight and an x that no kernel in between writes (kernels/pdl.py rule 3: x
            # through L2), so this GEMV runs while the routing kernel still does; the wait comes
            # before any write
            g_rows = w_ptr + SHARED_ID * (2 * INTER * H) + row_offs
            acc_g, acc_u = _gate_up_rows(g_rows, g_rows + INTER * H, x_rows, x_ok, n, INTER, H,
                                         BLOCK_K, K_ITERS, ".cg")
            if PDL:
                tl.extra.cuda.gdc_wait()
        else:
            if PDL:
                tl.extra.cuda.gdc_wait()  # the ids are the previous kernel's (routing) output
            g_rows = w_ptr + tl.load(ids_ptr + p0).to(tl.int64) * (2 * INTER * H) + row_offs
            acc_g, acc_u = _gate_up_rows(g_rows, g_rows + INTER * H, x_rows, x_ok, n, INTER, H,
                                         BLOCK_K, K_ITERS, "")
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()  # the ids are the previous kernel's (routing) output
        expert = _expert(ids_ptr, p0, shared, SHARED_ID, ONCE_ROWS, "")
        g_rows = w_ptr + expert * (2 * INTER * H) + row_offs
        acc_g, acc_u = _gate_up_rows(g_rows, g_rows + INTER * H, x_rows, x_ok, n, INTER, H, BLOCK_K,
                                     K_ITERS, "")
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    keep = (n < INTER) & (tok < T_ROWS) if ONCE_ROWS > 0 else n < INTER
    _store_swiglu(h_ptr + pair * INTER + n, acc_g, acc_u, keep, OUT_DTYPE)


def _down_gemv_kernel(
    h_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr, K_TOP: tl.constexpr, SHARED_ID: tl.constexpr, T_ROWS: tl.constexpr,
    ONCE_ROWS: tl.constexpr,
):
    # program rows as in the gate_up kernel (_program_rows); its x is h
    shared, n, tok, pair, p0 = _program_rows(tl.program_id(0), tl.program_id(1), K_TOP, T_ROWS,
                                             ONCE_ROWS, BLOCK_N)
    # with PDL: launched while gate_up may still run, but after every gate_up program passed its
    # wait: the routing kernel's ids are complete; read them through L2 (kernels/pdl.py, rule 3)
    expert = _expert(ids_ptr, p0, shared, SHARED_ID, ONCE_ROWS, ".cg" if PDL else "")
    h_rows = h_ptr + pair[:, None] * INTER
    h_ok = tok[:, None] < T_ROWS if ONCE_ROWS > 0 else True
    rows = w_ptr + expert * (H * INTER) + n[:, None].to(tl.int64) * INTER
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w = _tile_w(rows, 0, True, n, H, INTER, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()  # h is gate_up's output
    hs = _tile_x(h_rows, 0, h_ok, INTER, BLOCK_K, "")
    for i in range(K_ITERS):
        cw, ch = w, hs
        w, hs = _tile_gemv(rows, h_rows, (i + 1) * BLOCK_K, i + 1 < K_ITERS, h_ok, n, H, INTER,
                           BLOCK_K, "")
        acc += cw.to(tl.float32) * ch.to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if ONCE_ROWS > 0:
        keep = (n < H) & (tok < T_ROWS)
        rw = tl.load(rw_ptr + pair, mask=keep, other=0.0).to(tl.float32)
    else:
        keep = n < H
        rw = tl.load(rw_ptr + p0).to(tl.float32)
    _store_weighted(out_ptr + pair * H + n, tl.sum(acc, axis=1), rw, keep, OUT_DTYPE)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """(gate_up kernel, down kernel) for one mode (``interpret`` is the cache key)."""
    del interpret
    ns = jit_functions(__name__, (_round_to, _tile_w, _tile_x, _tile_gemv, _routed_pair,
                                  _store_swiglu, _store_weighted, _program_rows, _gate_up_rows,
                                  _expert, _gate_up_gemv_kernel, _down_gemv_kernel))
    return ns["_gate_up_gemv_kernel"], ns["_down_gemv_kernel"]


def moe_gemv_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    shared_expert_early: bool = False,
    shared_expert_once: bool = False,
    one_launch: bool = False,
) -> torch.Tensor:
    """Each (token, expert) pair's weighted expert output ``[T, k, H]`` in ``x.dtype``.

    Args:
        x: ``[T, H]`` fp32 / bf16 / fp16 (meant for ``T = 1``; correct for any ``T``).
        expert_ids: ``[T, k]`` integer expert ids (``< E``).
        weights: ``[T, k]`` routing weights (any float dtype; used in fp32).
        gate_up: ``[E, 2I, H]`` contiguous, x's dtype.
        down: ``[E, H, I]`` contiguous, x's dtype.
        shared_expert_early: every token's last pair is expert ``E - 1`` (the folded shared
            expert, ``MoE.fold_shared_expert``; the gate_up kernel takes it as that without
            reading the column, the down kernel reads it), and
            ``x`` was complete before the kernel that writes ``expert_ids`` passed its PDL wait
            (the MoE's routing kernel, launched after x's producer: kernels/pdl.py rule 3).
            With programmatic dependent launch the gate_up programs of those pairs then run
            before their wait, while the routing kernel still runs. Needs ``k >= 2`` (a routed
            column keeps rule 2 for the down kernel). The result is the same, bit for bit.
        one_launch: gate_up and down in one launch joined by per-pair counters
            (kernels/moe_one_launch.py; up to ``moe_one_launch.MAX_PAIRS`` pairs, not with
            ``shared_expert_once``); with ``shared_expert_early`` the shared expert's down runs
            before the PDL wait too. The result is the same, bit for bit.
        shared_expert_once: every token's last pair is expert ``E - 1`` (the column is not
            read). With 2..4 tokens that expert's weights are read once for all of them
            instead of once per token: its programs take fewer rows each for every token (the
            same tile shape and arithmetic as a pair's), so the result is the same, bit for bit.

    Returns:
        ``[T, k, H]``: pair ``(t, j)`` is ``w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)``, the
        contract of ``fused_moe.fused_moe_experts(..., reduce=False)``.
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
    if (shared_expert_early or shared_expert_once) and k < 2:
        raise ValueError("shared_expert_early / shared_expert_once need k >= 2 columns (routed "
                         "experts and the shared one); pass False")
    if one_launch and not shared_expert_once:
        from .moe_one_launch import MAX_PAIRS, experts_one_launch  # (it imports this module)

        if p <= MAX_PAIRS:
            experts_one_launch(x, ids, rw, gate_up, down, out, shared_expert_early)
            return out
    shared_id = e - 1 if shared_expert_early or shared_expert_once else -1
    # the shared expert once for all tokens: from 2 tokens (at 1 it is one pair anyway)
    once_rows = (2 if t == 2 else 4) if shared_expert_once and 2 <= t <= 4 else 0
    groups = t * (k - 1) + once_rows if once_rows else p
    rows = dict(K_TOP=k, SHARED_ID=shared_id, T_ROWS=t if once_rows else 0, ONCE_ROWS=once_rows)
    bn, bk, nw = GATE_UP_CONFIG
    gate_up_kernel[(groups, -(-inter // bn))](
        x, gate_up, ids, h, H=hidden, INTER=inter, BLOCK_N=bn, BLOCK_K=bk,
        K_ITERS=-(-hidden // bk), OUT_DTYPE=code, PDL=use_pdl, EARLY=shared_expert_early,
        num_warps=nw, **rows, **pdl.launch_options(use_pdl))
    bn, bk, nw = DOWN_CONFIG
    down_kernel[(groups, -(-hidden // bn))](
        h, down, ids, rw, out, H=hidden, INTER=inter, BLOCK_N=bn, BLOCK_K=bk,
        K_ITERS=-(-inter // bk), OUT_DTYPE=code, PDL=use_pdl, num_warps=nw, **rows,
        **pdl.launch_options(use_pdl))
    return out
