"""The GEMV experts of ``kernels/moe_gemv.py`` in ONE launch, gate_up and down joined by per-pair
completion counters instead of a kernel boundary.

Same math, tiles and result (bit for bit) as :func:`moe_gemv.moe_gemv_experts`: program kinds
are the two kernels' programs, ``(pair, block)`` tiles of gate_up (``GATE_UP_CONFIG``) and of
down (``DOWN_CONFIG``). What changes is the dependency: a down tile of pair ``p`` starts when
pair ``p``'s gate_up tiles are stored, not when the whole gate_up grid has finished, so down
streams while gate_up's last wave drains; and with ``shared_early`` the folded shared expert
(every token's last pair, expert ``E - 1``, known before the routing) runs both its gate_up and
its down before the PDL wait, while the routing kernel still routes.

Scheduling (no deadlock whatever the hardware's dispatch order): each program first takes a
ticket from a counter (``atomic_add``); tickets, not program ids, name the work, in the order
[shared gate_up][shared down][routed gate_up][routed down]. A tile only ever waits for tiles of
lower tickets, which are held by programs already running, and those wait on nothing but the
previous kernel (the routing kernel, fully launched before this one: kernels/pdl.py). A gate_up
tile stores its rows of ``h`` (a workspace of this module), passes a CTA barrier and adds 1 to
its pair's counter with release semantics; a down tile loads its first weight tile, spins on
the counter with acquire semantics until the pair's ``ceil(I / BLOCK_N)`` tiles arrived, then
reads ``h`` through L2 (``.cg``). The last program to finish (an ``acq_rel`` counter) re-arms
the ticket, the pair counters and itself for the next call: no memset, CUDA-graph replayable.

PDL (kernels/pdl.py): every program executes one ``gdc_wait`` before it reads the routing
kernel's outputs (ids, weights) and before it writes ``out``; the shared tiles with
``shared_early`` run before their wait and write only ``h``, which is private to this module's
calls (the previous call, one layer earlier, completed before this kernel launched: rule 2), and
read ``x`` through L2 (rule 3: the routing kernel's input). The workspaces (``h``, counters) are
cached per ``(device, I, dtype)`` and never freed (graphs point at them); make the first call of a
shape outside a graph capture, and do not run two calls concurrently on different streams.

Under Triton's CPU interpreter programs run one after another in program order, so the tickets
equal the program ids and every counter is complete before its reader runs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import pdl
from .availability import interpret_mode
from .jit import DTYPE_CODE, _round_to, jit_functions
from .moe_gemv import (
    DOWN_CONFIG,
    GATE_UP_CONFIG,
    _gate_up_rows,
    _routed_pair,
    _store_swiglu,
    _store_weighted,
    _tile_gemv,
    _tile_w,
    _tile_x,
)

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["MAX_PAIRS", "experts_one_launch"]

MAX_PAIRS = 64  # (token, expert) pairs of one call (rows of the h workspace)
# Warps per program: 4 as the two kernels (GATE_UP_CONFIG, DOWN_CONFIG). Offline ptxas (sm_90a)
# gives this kernel 96 registers a thread at 4 warps (5 programs an SM) and 64 at 8 (4 programs
# of twice the threads); each tile row keeps its lanes either way, so the sums are the same.
# An A/B knob until timed (benchmarks/gpu_check.sh shared).
NUM_WARPS = 4


def _pair_of(i, K_TOP: tl.constexpr, SHARED: tl.constexpr):
    # the pair of the i-th shared (SHARED and i < T) or routed tile group: shared pair i is token
    # i's last column; routed groups skip the last column when it is the shared expert
    if SHARED:
        return _routed_pair(i, K_TOP)
    return i


def _gate_up_tile(x_ptr, gu_ptr, h_ptr, done_ptr, expert, p, b, K_TOP: tl.constexpr,
                  H: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, OUT_DTYPE: tl.constexpr,
                  X_CACHE: tl.constexpr):
    # pair p's gate_up block b (moe_gemv's gate_up program), stored to h, then the pair's counter
    offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + (p // K_TOP).to(tl.int64) * H + offs_n[:, None] * 0
    g_rows = gu_ptr + expert * (2 * INTER * H) + offs_n[:, None].to(tl.int64) * H
    acc_g, acc_u = _gate_up_rows(g_rows, g_rows + INTER * H, x_rows, True, offs_n, INTER, H, BLOCK_K,
                                 K_ITERS, X_CACHE)
    _store_swiglu(h_ptr + p.to(tl.int64) * INTER + offs_n, acc_g, acc_u, offs_n < INTER, OUT_DTYPE)
    tl.debug_barrier()  # every thread's rows stored before the one release below
    tl.atomic_add(done_ptr + p, 1, sem="release", scope="gpu")


def _down_acc(dn_ptr, h_ptr, done_ptr, expert, p, b, H: tl.constexpr, INTER: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
              NUM_H_TILES: tl.constexpr):
    # pair p's down block b (moe_gemv's down program) once the pair's NUM_H_TILES gate_up tiles
    # are stored: (rows, fp32 row sums); the first weight tile is loaded before the spin
    offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = dn_ptr + expert * (H * INTER) + offs_n[:, None].to(tl.int64) * INTER
    w = _tile_w(rows, 0, True, offs_n, H, INTER, BLOCK_K)
    arrived = tl.atomic_add(done_ptr + p, 0, sem="acquire", scope="gpu")
    while arrived < NUM_H_TILES:
        arrived = tl.atomic_add(done_ptr + p, 0, sem="acquire", scope="gpu")
    h_rows = h_ptr + p.to(tl.int64) * INTER + offs_n[:, None] * 0
    hs = _tile_x(h_rows, 0, True, INTER, BLOCK_K, ".cg")  # written by other programs: from L2
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(K_ITERS):
        cw, ch = w, hs
        w, hs = _tile_gemv(rows, h_rows, (i + 1) * BLOCK_K, i + 1 < K_ITERS, True, offs_n, H, INTER,
                           BLOCK_K, ".cg")
        acc += cw.to(tl.float32) * ch.to(tl.float32)
    return offs_n, tl.sum(acc, axis=1)


def _store_out(out_ptr, rw_ptr, p, offs_n, total, H: tl.constexpr, OUT_DTYPE: tl.constexpr):
    # pair p's weighted rows: its routing weight times the fp32 sums, rounded once
    _store_weighted(out_ptr + p.to(tl.int64) * H + offs_n, total, tl.load(rw_ptr + p).to(tl.float32),
                    offs_n < H, OUT_DTYPE)


def _shared_tile(x_ptr, gu_ptr, dn_ptr, rw_ptr, h_ptr, out_ptr, done_ptr, w, S: tl.constexpr,
                 K_TOP: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
                 BN1: tl.constexpr, BK1: tl.constexpr, KI1: tl.constexpr,
                 BN2: tl.constexpr, BK2: tl.constexpr, KI2: tl.constexpr,
                 OUT_DTYPE: tl.constexpr, PDL: tl.constexpr, SHARED_ID: tl.constexpr):
    # ticket w < S (NB1 + NB2): a tile of the shared expert, whose expert is known without the
    # routing, so it runs before the PDL wait (module docstring) and waits only before it reads
    # the routing weight and writes out
    NB1: tl.constexpr = (INTER + BN1 - 1) // BN1
    NB2: tl.constexpr = (H + BN2 - 1) // BN2
    if w < S * NB1:
        _gate_up_tile(x_ptr, gu_ptr, h_ptr, done_ptr, SHARED_ID, (w // NB1) * K_TOP + K_TOP - 1,
                      w % NB1, K_TOP, H, INTER, BN1, BK1, KI1, OUT_DTYPE, ".cg")
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
    else:
        v = w - S * NB1
        p = (v // NB2) * K_TOP + K_TOP - 1
        offs_n, total = _down_acc(dn_ptr, h_ptr, done_ptr, SHARED_ID, p, v % NB2, H, INTER, BN2,
                                  BK2, KI2, NB1)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _store_out(out_ptr, rw_ptr, p, offs_n, total, H, OUT_DTYPE)


def _routed_tile(x_ptr, gu_ptr, dn_ptr, ids_ptr, rw_ptr, h_ptr, out_ptr, done_ptr, v,
                 R: tl.constexpr, K_TOP: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
                 BN1: tl.constexpr, BK1: tl.constexpr, KI1: tl.constexpr,
                 BN2: tl.constexpr, BK2: tl.constexpr, KI2: tl.constexpr,
                 OUT_DTYPE: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr):
    # routed ticket v (counted from the first routed tile): a gate_up tile of the R routed pairs,
    # then their down tiles; after the PDL wait (the ids and weights are the routing's output)
    NB1: tl.constexpr = (INTER + BN1 - 1) // BN1
    NB2: tl.constexpr = (H + BN2 - 1) // BN2
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if v < R * NB1:
        p = _pair_of(v // NB1, K_TOP, SHARED)
        _gate_up_tile(x_ptr, gu_ptr, h_ptr, done_ptr, tl.load(ids_ptr + p).to(tl.int64), p,
                      v % NB1, K_TOP, H, INTER, BN1, BK1, KI1, OUT_DTYPE, "")
    else:
        v -= R * NB1
        p = _pair_of(v // NB2, K_TOP, SHARED)
        offs_n, total = _down_acc(dn_ptr, h_ptr, done_ptr, tl.load(ids_ptr + p).to(tl.int64), p,
                                  v % NB2, H, INTER, BN2, BK2, KI2, NB1)
        _store_out(out_ptr, rw_ptr, p, offs_n, total, H, OUT_DTYPE)


def _experts_one_launch_kernel(
    x_ptr, gu_ptr, dn_ptr, ids_ptr, rw_ptr, h_ptr, out_ptr, sync_ptr,
    T: tl.constexpr, K_TOP: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BN1: tl.constexpr, BK1: tl.constexpr, KI1: tl.constexpr,
    BN2: tl.constexpr, BK2: tl.constexpr, KI2: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PDL: tl.constexpr, SHARED_ID: tl.constexpr, PAIRS_PAD: tl.constexpr,
):
    # sync_ptr: int32 [2 + MAX_PAIRS] = ticket counter, finished counter, one counter per pair;
    # SHARED_ID >= 0: every token's last pair is that expert, run early (shared_early), -1: none;
    # PAIRS_PAD: next_pow2(T K_TOP) (the reset's vector)
    NB1: tl.constexpr = (INTER + BN1 - 1) // BN1
    NB2: tl.constexpr = (H + BN2 - 1) // BN2
    SHARED: tl.constexpr = SHARED_ID >= 0
    S: tl.constexpr = T if SHARED_ID >= 0 else 0  # shared pairs (one per token), scheduled first
    R: tl.constexpr = T * K_TOP - S
    TOTAL: tl.constexpr = (S + R) * (NB1 + NB2)
    done_ptr = sync_ptr + 2
    w = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")  # the work ticket
    if SHARED:
        if w < S * (NB1 + NB2):
            _shared_tile(x_ptr, gu_ptr, dn_ptr, rw_ptr, h_ptr, out_ptr, done_ptr, w, S, K_TOP, H,
                         INTER, BN1, BK1, KI1, BN2, BK2, KI2, OUT_DTYPE, PDL, SHARED_ID)
        else:
            _routed_tile(x_ptr, gu_ptr, dn_ptr, ids_ptr, rw_ptr, h_ptr, out_ptr, done_ptr,
                         w - S * (NB1 + NB2), R, K_TOP, H, INTER, BN1, BK1, KI1, BN2, BK2, KI2,
                         OUT_DTYPE, PDL, SHARED)
    else:
        _routed_tile(x_ptr, gu_ptr, dn_ptr, ids_ptr, rw_ptr, h_ptr, out_ptr, done_ptr, w, R, K_TOP,
                     H, INTER, BN1, BK1, KI1, BN2, BK2, KI2, OUT_DTYPE, PDL, SHARED)
    # the last program to finish re-arms the ticket, the pair counters and itself
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == TOTAL - 1:
        offs = tl.arange(0, PAIRS_PAD)
        tl.store(sync_ptr + 2 + offs, tl.zeros([PAIRS_PAD], dtype=tl.int32), mask=offs < S + R)
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key)."""
    del interpret
    ns = jit_functions(__name__, (_round_to, _tile_w, _tile_x, _tile_gemv, _gate_up_rows,
                                  _routed_pair, _store_swiglu, _store_weighted, _pair_of,
                                  _gate_up_tile, _down_acc, _store_out, _shared_tile, _routed_tile,
                                  _experts_one_launch_kernel))
    return ns["_experts_one_launch_kernel"]


_WORKSPACES: dict[tuple[torch.device, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(h ``[MAX_PAIRS, I]`` of dtype, counters ``[2 + MAX_PAIRS]`` int32 zero), allocated once."""
    key = (device, inter, dtype)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = (torch.empty((MAX_PAIRS, inter), dtype=dtype, device=device),
                                 torch.zeros(2 + MAX_PAIRS, dtype=torch.int32, device=device))
    return ws


def experts_one_launch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                       shared_early: bool) -> None:
    """:func:`moe_gemv.moe_gemv_experts`' pairs into ``out [T, k, H]`` in one launch (module
    docstring); operands as checked there (``x`` contiguous, ``ids`` / ``weights`` flat
    contiguous ``[T k]``), ``T k <= MAX_PAIRS``. ``shared_early``: every token's last pair is the
    shared expert ``E - 1`` (its id column is not read), computed before the PDL wait."""
    t, k, hidden = out.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    assert t * k <= MAX_PAIRS, "experts_one_launch: more pairs than the h workspace holds"
    h, sync = _workspace(x.device, inter, x.dtype)
    interpret = interpret_mode()
    use_pdl = pdl.active(x.device, interpret)
    (bn1, bk1, _), (bn2, bk2, _) = GATE_UP_CONFIG, DOWN_CONFIG
    num_programs = t * k * (-(-inter // bn1) + -(-hidden // bn2))
    _kernel(interpret)[(num_programs,)](
        x, gate_up, down, ids, weights, h, out, sync,
        T=t, K_TOP=k, H=hidden, INTER=inter, BN1=bn1, BK1=bk1, KI1=-(-hidden // bk1),
        BN2=bn2, BK2=bk2, KI2=-(-inter // bk2), OUT_DTYPE=DTYPE_CODE[x.dtype], PDL=use_pdl,
        SHARED_ID=e - 1 if shared_early else -1, PAIRS_PAD=1 << max(0, t * k - 1).bit_length(), num_warps=NUM_WARPS,
        **pdl.launch_options(use_pdl),
    )
