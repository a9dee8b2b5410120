"""Paged attention over the KV cache in Triton: decode, verify, the DFlash drafter block, prefill.

Same contract as ``TorchSDPABackend.attend`` (``engine/attention.py``), computed straight from the
paged cache: no padded copy of the context, no ``[R, Qmax, Lmax]`` mask.

Inputs (the fields of ``AttentionMetadata``): ``T`` flat query tokens of ``R`` requests; padded
query ``(r, i)`` (``i < Qmax``) is flat token ``query_index[r, i]`` at absolute position
``p = query_positions[r, i]`` (``p < 0``: padding); key ``j`` of request ``r`` is at cache slot
``key_slots[r, j]`` and is visible when ``j < seq_lens[r]``.

Math, per request ``r``, query head ``h``, its KV head ``g = h // G`` (GQA, ``G = H / KVH``)::

    s_j   = scale * <q_{p,h}, K[key_slots[r, j], g]>                     for allowed j
    out   = sum_j exp(s_j - m) V[key_slots[r, j], g] / (exp(sink_h - m) + sum_j exp(s_j - m))

with ``m`` any shift (the running max below) and the sink term present only for layers with
sinks (``sink_h`` a raw logit: it is not scaled). ``j`` is allowed when ``j < seq_len`` and

    causal:                 j <= p
    window W, causal:       p - W < j <= p
    window W, bidirectional |p - j| < W         (the DFlash ``use_swa`` layers)
    bidirectional, no W:    every j < seq_len   (the drafter block sees the context + whole block)

exactly ``AttentionMetadata.mask``. Padding queries are not computed (the output is indexed by
flat token, and every flat token is one valid padded query).

Tiling. One program owns request ``r``, KV head ``g`` and a tile of ``BLOCK_Q`` consecutive
queries; its ``BLOCK_M = BLOCK_Q * G`` (padded to a power of two, >= 16) rows are the pairs
(query, head of the group), row ``m`` -> query ``m // G``, head ``g * G + m % G``. So the K/V
tile of a KV head is loaded once for all the query heads that share it, and a single decode
token with ``G = 8`` still fills a 16-row MMA. The program walks key tiles of ``BLOCK_N`` keys
with the online softmax of flash attention (base 2: logits are pre-multiplied by
``scale * log2(e)``)::

    m'   = max(m, max_j s_j)          alpha = 2^(m - m')     P_j = 2^(s_j - m')
    l'   = alpha * l + sum_j P_j      acc'  = alpha * acc + P @ V_tile

in fp32 (``P`` is rounded to the input dtype for the second MMA, as in flash attention).
Only the key tiles some row of the program can see are visited: ``[lo, hi)`` with
``hi = min(seq_len, p_max + 1)`` (causal) or ``min(seq_len, p_max + W)`` (bidirectional window)
or ``seq_len``, and ``lo = p_min - W + 1`` with a window; elementwise masks inside the tile do the
rest. Loop bounds are read on the device: the grid depends only on shapes.

Programmatic dependent launch (kernels/pdl.py): q and the K/V of the forward's own positions are
the previous kernel's output; the metadata and the K/V at positions before a request's first
query are not (earlier forwards wrote them). So with ``PRELOAD_OLD_KEYS``, while a request holds
at most ``PRELOAD_MAX_QUERIES`` query tokens (16 by default: decode, the verify up to K = 15
and the drafter block), a program loads its metadata, its first key tile's slots and that tile's K/V
before the first query position, then waits, then loads q and the tile's remaining (new) K/V:
the wait no longer heads a chain of four dependent reads.

Split-K (flash decoding): when ``R * KVH * ceil(Qmax / BLOCK_Q)`` programs cannot fill the GPU
(decode of a few long requests) the key axis ``[0, Lmax)`` is cut into ``S`` chunks of
``split_len`` keys (a multiple of ``BLOCK_N``, ``S`` chosen from the shapes on the host). Each
program then writes its unnormalised ``acc``, ``m`` and ``l`` to fp32 scratch and a second
kernel merges them (sink included). A program whose chunk holds no visible key (past
``seq_len`` or outside the window) stores ``m = -inf`` and ``l = 0`` only, and the merge skips
``acc`` where ``m = -inf`` (``SKIP_EMPTY_SPLITS``)::

    M = max(max_s m_s, sink)    out = sum_s 2^(m_s - M) acc_s / (2^(sink - M) + sum_s 2^(m_s - M) l_s)

Rows that see no key at all (impossible for a valid query: it sees itself) produce zeros.

Triton's CPU interpreter (``TRITON_INTERPRET=1``) cannot run a loop to a bound read from a tensor,
so there the key loop runs a static count of tiles over the whole split and masks the tiles
outside ``[lo, hi)``; the tile body is the same function in both modes. Its bf16 ``tl.dot`` is
also wrong in triton 3.6, so the interpreter multiplies in fp32 (bf16 products are exact in fp32:
same result up to accumulation order).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import l2_prefetch, pdl
from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["choose_num_splits", "is_available", "paged_attention"]

_prefetch_l2 = l2_prefetch._prefetch_l2  # helpers of the attention kernel (jitted with it)
_prefetch_l2_lanes = l2_prefetch._prefetch_l2_lanes


# ---- availability ---------------------------------------------------------------------------------


def is_available(device: torch.device | str) -> bool:
    """Whether :func:`paged_attention` can run on ``device``: triton importable and either a CUDA
    device of compute capability >= 8.0 (bf16 MMA), or a CPU under ``TRITON_INTERPRET=1``."""
    return triton_can_run(device, min_major=8)


# ---- Triton kernels -------------------------------------------------------------------------------
#
# Plain Python here; :func:`_kernels` decorates copies bound to a fresh globals dict (triton stays
# an optional import, and helpers resolve through that dict both compiled and interpreted), as in
# ``kernels/context_kv.py``. log2(e) is spelled as a literal: jitted code may only read constexpr
# globals.


def _mma(a, b, IEEE: tl.constexpr):
    # a @ b with fp32 accumulation. IEEE: exact fp32 products (fp32 inputs, where the default
    # would be tf32; and the CPU interpreter, whose bf16 tl.dot is wrong in triton 3.6).
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def _softplus_rounded(g, dtype):
    # The output gate's factor as the reference computes it: softplus in fp32, rounded to the
    # output dtype (``out * F.softplus(g.float()).to(out.dtype)``; the caller rounds ``out`` to
    # that dtype first). softplus(g) = log(1 + e^g), and g itself above torch's threshold 20;
    # log(1 + y) ~ y - y^2/2 for tiny y, where 1 + y would round to 1 in fp32.
    g = g.to(tl.float32)
    y = tl.exp(tl.minimum(g, 20.0))
    sp = tl.where(y < 1e-4, y * (1.0 - 0.5 * y), tl.log(1.0 + y))
    return tl.where(g > 20.0, g, sp).to(dtype).to(tl.float32)


def _tile_slots(start, lo, hi, ks_row_ptr, stride_ks_j, BLOCK_N: tl.constexpr):
    # key tile [start, start + BLOCK_N): positions j, which of them lie in [lo, hi), their slots
    j = start + tl.arange(0, BLOCK_N)
    j_in = (j >= lo) & (j < hi)  # hi <= seq_len <= Lmax: in-bounds key_slots, visible keys
    slot = tl.load(ks_row_ptr + j * stride_ks_j, mask=j_in, other=0, cache_modifier=".cg").to(tl.int64)
    return j, j_in, slot


def _load_keys(head_ptr, slot, ok, stride_s, stride_d, offs_d, d_ok):
    # K or V rows [BLOCK_N, BLOCK_D] of the tile's slots where ok; 0 elsewhere (never the
    # scratch slot's contents: 0 * NaN would poison P@V). Through L2 (.cg): kernels/pdl.py rule 3
    return tl.load(head_ptr + slot[:, None] * stride_s + offs_d[None, :] * stride_d,
                   mask=ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")


def _tile_logits(q, k, j, j_in, pos, scale_log2, window,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    # base-2 logits [BLOCK_M, BLOCK_N] of one key tile, fp32, -inf where AttentionMetadata.mask
    # forbids the (row, key) pair
    s = _mma(q, tl.trans(k.to(q.dtype)), IEEE) * scale_log2
    jj = j[None, :]
    pp = pos[:, None]
    allowed = j_in[None, :]
    if CAUSAL:
        allowed = allowed & (jj <= pp)
    if HAS_WINDOW:
        allowed = allowed & (jj > pp - window)
        if not CAUSAL:
            allowed = allowed & (jj < pp + window)
    return tl.where(allowed, s, float("-inf"))


def _softmax_step(s, m_i, l_i):
    # online softmax over one tile's logits: (m', l', P, alpha). A row with nothing allowed so
    # far keeps m = -inf and shifts by 0 instead (so 2^(-inf - -inf) never appears)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


def _attend_tile(
    start, lo, hi, q, pos, m_i, l_i, acc,
    ks_row_ptr, stride_ks_j, k_head_ptr, v_head_ptr,
    stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d,
    offs_d, d_ok, scale_log2, window,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    # One key tile [start, start + BLOCK_N) of one program; returns the updated (m, l, acc).
    # q [BLOCK_M, BLOCK_D] in the input dtype, pos [BLOCK_M] query positions (-1: no query).
    j, j_in, slot = _tile_slots(start, lo, hi, ks_row_ptr, stride_ks_j, BLOCK_N)
    k = _load_keys(k_head_ptr, slot, j_in, stride_kc_s, stride_kc_d, offs_d, d_ok)
    s = _tile_logits(q, k, j, j_in, pos, scale_log2, window, CAUSAL, HAS_WINDOW, IEEE)
    m_new, l_i, p, alpha = _softmax_step(s, m_i, l_i)
    v = _load_keys(v_head_ptr, slot, j_in, stride_vc_s, stride_vc_d, offs_d, d_ok).to(q.dtype)
    acc = acc * alpha[:, None] + _mma(p.to(q.dtype), v, IEEE)
    return m_new, l_i, acc


def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr, gate_ptr,
    query_index_ptr, query_pos_ptr, key_slots_ptr, seq_lens_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, prefetch_ptr, prefetch_nbytes, prefetch_chunk,
    stride_qt, stride_qh, stride_qd,
    stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_s, stride_vc_h, stride_vc_d,
    stride_ot, stride_oh, stride_od,
    stride_qi_r, stride_qi_q, stride_qp_r, stride_qp_q, stride_ks_r, stride_ks_j,
    stride_gt, stride_gh, num_tokens, qmax, split_len, scale_log2, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_GATE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, SPLIT_TILES: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, PRELOAD: tl.constexpr, EARLY_SIGNAL: tl.constexpr,
    SKIP_EMPTY: tl.constexpr, PARTIALS: tl.constexpr, RELATIVE: tl.constexpr,
):
    # grid (R, KVH, ceil(Qmax / BLOCK_Q) * NUM_SPLITS): program (r, g, tile * S + split).
    # PARTIALS: store (acc, m, l) for the merge kernel (split-K; and batch-invariant, one split too)
    if PDL and EARLY_SIGNAL:  # EARLY_SIGNAL below: the next kernel reads nothing before its wait
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH > 0:  # the next kernel's weight into L2 in chunks of PREFETCH lanes a program
        # (kernels/l2_prefetch.py); never written, so issued before the PDL wait
        part = ((tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
                + tl.program_id(2))
        _prefetch_l2(prefetch_ptr, prefetch_nbytes, prefetch_chunk, part, PREFETCH)
    if PDL and not PRELOAD:  # kernels/pdl.py: q and the new keys are the previous kernel's output
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    # rows = (query of the tile, head of the GQA group). The metadata is no kernel's output in
    # the forward (kernels/pdl.py rule 3): with PRELOAD it is read before the PDL wait
    offs_m = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + offs_m // GROUP
    head = g * GROUP + offs_m % GROUP
    row_in = (offs_m < BLOCK_Q * GROUP) & (qi < qmax)
    pos = tl.load(query_pos_ptr + r * stride_qp_r + qi * stride_qp_q, mask=row_in, other=-1,
                  cache_modifier=".cg").to(tl.int64)
    row_ok = pos >= 0
    token = tl.load(query_index_ptr + r * stride_qi_r + qi * stride_qi_q, mask=row_ok, other=0,
                    cache_modifier=".cg").to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r, cache_modifier=".cg").to(tl.int64)
    # the request's first query position: keys before it were written by earlier forwards, keys
    # from it on by the kernel before this one (a request's queries are its newest positions,
    # ascending: runner.build_metadata and the graph runner's metadata build them so)
    first_new = tl.load(query_pos_ptr + r * stride_qp_r, cache_modifier=".cg").to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # keys [lo, hi) that some row of the tile can see, cut to this program's split
    p_max = tl.max(pos, 0)  # -1 when the tile holds no query
    p_min = tl.min(tl.where(row_ok, pos, p_max), 0)
    if CAUSAL:
        hi = tl.minimum(seq_len, p_max + 1)
    elif HAS_WINDOW:
        hi = tl.minimum(seq_len, p_max + window)
    else:
        hi = seq_len
    hi = tl.where(p_max >= 0, hi, 0)
    if HAS_WINDOW:
        lo = tl.maximum(p_min - window + 1, 0)
    else:
        lo = p_min * 0
    if RELATIVE:
        # the tile's visible keys [lo, hi), from their first whole key tile, cut into NUM_SPLITS
        # chunks of whole tiles: every split holds ~1/S of the keys the tile sees, wherever
        # they lie (a window at the end of a long key axis, a context short of its bucket);
        # the chunk length is at most split_len (the interpreter's static trip count)
        base = lo // BLOCK_N * BLOCK_N
        chunk = tl.maximum(hi - base, 0)
        chunk = ((chunk + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        split_lo = base + split.to(tl.int64) * chunk
        split_hi = split_lo + chunk
    else:  # absolute: chunks of split_len keys from key 0 (batch-invariant boundaries)
        split_lo = split.to(tl.int64) * split_len
        split_hi = split_lo + split_len
    lo = tl.maximum(lo, split_lo)
    hi = tl.minimum(hi, split_hi)

    ks_row_ptr = key_slots_ptr + r * stride_ks_r
    k_head_ptr = k_cache_ptr + g * stride_kc_h
    v_head_ptr = v_cache_ptr + g * stride_vc_h
    # the program's first key tile, peeled: its keys before first_new are loaded before the wait
    # (with PRELOAD), the rest after it. An empty tile (lo >= hi) changes nothing below: its
    # logits are all -inf, so m stays -inf and l, acc stay 0.
    if DYNAMIC_LOOP:
        start0 = lo // BLOCK_N * BLOCK_N  # compiled: the first tile overlapping [lo, hi)
    else:
        start0 = split_lo  # interpreter: every tile of the split (a static count, masked)
    j0, j0_in, slot0 = _tile_slots(start0, lo, hi, ks_row_ptr, stride_ks_j, BLOCK_N)
    j0_old = j0_in & (j0 < first_new)
    k0 = _load_keys(k_head_ptr, slot0, j0_old, stride_kc_s, stride_kc_d, offs_d, d_ok)
    v0 = _load_keys(v_head_ptr, slot0, j0_old, stride_vc_s, stride_vc_d, offs_d, d_ok)
    if PDL and PRELOAD:
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    j0_new = j0_in & (j0 >= first_new)
    k0 = tl.where(j0_new[:, None], _load_keys(k_head_ptr, slot0, j0_new, stride_kc_s, stride_kc_d, offs_d, d_ok), k0)
    v0 = tl.where(j0_new[:, None], _load_keys(v_head_ptr, slot0, j0_new, stride_vc_s, stride_vc_d, offs_d, d_ok), v0)
    s0 = _tile_logits(q, k0, j0, j0_in, pos, scale_log2, window, CAUSAL, HAS_WINDOW, IEEE)
    m_i, l_i, p0, _ = _softmax_step(s0, tl.full([BLOCK_M], float("-inf"), tl.float32),
                                    tl.zeros([BLOCK_M], tl.float32))
    acc = _mma(p0.to(q.dtype), v0.to(q.dtype), IEEE)
    if DYNAMIC_LOOP:
        # compiled: the other tiles overlapping [lo, hi) (split_lo is tile-aligned)
        for start in range(start0 + BLOCK_N, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                start, lo, hi, q, pos, m_i, l_i, acc, ks_row_ptr, stride_ks_j, k_head_ptr, v_head_ptr,
                stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d, offs_d, d_ok, scale_log2, window,
                CAUSAL, HAS_WINDOW, BLOCK_N, IEEE)
    else:
        # interpreter: every other tile of the split, those outside [lo, hi) fully masked (a
        # constexpr trip count: the interpreter holds even scalar arguments as arrays)
        for t in range(1, SPLIT_TILES):
            m_i, l_i, acc = _attend_tile(
                split_lo + t * BLOCK_N, lo, hi, q, pos, m_i, l_i, acc, ks_row_ptr, stride_ks_j,
                k_head_ptr, v_head_ptr, stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d,
                offs_d, d_ok, scale_log2, window, CAUSAL, HAS_WINDOW, BLOCK_N, IEEE)

    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out_mask = row_ok[:, None] & d_ok[None, :]
    if not PARTIALS:
        if HAS_SINKS:
            # the sink joins the denominator only: l += 2^(sink - m) after shifting to
            # m' = max(m, sink) (sink in base 2 too)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
        # rows that saw nothing have acc = 0, l = 0: divide by 1 instead (output 0)
        out = acc * (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
        if HAS_GATE:
            g = tl.load(gate_ptr + token * stride_gt + head * stride_gh, mask=row_ok, other=0.0)
            out = out.to(out_ptr.dtype.element_ty).to(tl.float32) * _softplus_rounded(
                g, out_ptr.dtype.element_ty)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial results of split s for (token, head): row (s * T + token) * H + head
        prow = (split.to(tl.int64) * num_tokens + token) * NUM_HEADS + head
        # SKIP_EMPTY: a split holding none of the tile's visible keys (past seq_len, before the
        # window) has acc = 0, m = -inf: it stores m and l only, and the merge skips acc where
        # m = -inf (where it would weigh it by 2^-inf = 0 anyway)
        acc_mask = out_mask & (hi > lo) if SKIP_EMPTY else out_mask
        tl.store(part_acc_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=acc_mask)
        tl.store(part_m_ptr + prow, m_i, mask=row_ok)
        tl.store(part_l_ptr + prow, l_i, mask=row_ok)


def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, gate_ptr, out_ptr,
    num_tokens, stride_ot, stride_oh, stride_od, stride_gt, stride_gh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_GATE: tl.constexpr,
    PDL: tl.constexpr, EARLY_SIGNAL: tl.constexpr, SKIP_EMPTY: tl.constexpr, SEQUENTIAL: tl.constexpr,
):
    # program (t, h): out[t, h] = sum_s 2^(m_s - M) acc_s / (2^(sink - M) + sum_s 2^(m_s - M) l_s)
    if PDL and EARLY_SIGNAL:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:  # kernels/pdl.py: the partials are the attention kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    prow = (offs_s.to(tl.int64) * num_tokens + t) * NUM_HEADS + h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m = tl.load(part_m_ptr + prow, mask=s_ok, other=float("-inf"))
    lsum = tl.load(part_l_ptr + prow, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_use)  # 0 for splits that saw no key
    # SKIP_EMPTY: splits with m = -inf stored no acc (their weight 2^(m - M) is 0 anyway)
    s_read = s_ok & (m > float("-inf")) if SKIP_EMPTY else s_ok
    acc = tl.load(part_acc_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_read[:, None] & d_ok[None, :], other=0.0)
    if SEQUENTIAL:
        # batch-invariant: the sums run split by split in split order, so their rounding does not
        # depend on NUM_SPLITS or BLOCK_S (tl.sum's order follows the lanes' layout). Each step
        # picks split s's term out of the loaded vectors with a sum that holds one nonzero
        # (exact); splits past a row's keys add exact zeros.
        lw = lsum * w
        aw = acc * w[:, None]
        denom = tl.sum(tl.where(offs_s == 0, lw, 0.0), 0)
        out = tl.sum(tl.where(offs_s[:, None] == 0, aw, 0.0), 0)
        for s in tl.static_range(1, NUM_SPLITS):
            denom += tl.sum(tl.where(offs_s == s, lw, 0.0), 0)
            out += tl.sum(tl.where(offs_s[:, None] == s, aw, 0.0), 0)
    else:
        denom = tl.sum(lsum * w, 0)
        out = tl.sum(acc * w[:, None], 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_use)
    out = out / tl.where(denom > 0.0, denom, 1.0)  # no key and no sink: acc = 0, output 0
    if HAS_GATE:
        g = tl.load(gate_ptr + t * stride_gt + h * stride_gh)
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32) * _softplus_rounded(g, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """(attention kernel, merge kernel) for one mode (``interpret`` is the cache key; triton reads
    the environment)."""
    del interpret
    namespace = jit_functions(__name__, (_mma, _softplus_rounded, _tile_slots, _load_keys,
                                         _tile_logits, _softmax_step, _attend_tile, _prefetch_l2_lanes, _prefetch_l2,
                                         _paged_attention_kernel, _merge_splits_kernel))
    return namespace["_paged_attention_kernel"], namespace["_merge_splits_kernel"]


# ---- launch configuration -------------------------------------------------------------------------

_TARGET_ROWS = 64  # BLOCK_M aimed at: query tokens x heads of a GQA group per program
# Split-K only cuts the key axis into chunks of at least this many keys. One 64-key tile per
# program at decode: a program's tiles run one after another (slot load -> K/V gather -> MMA), so
# latency, not bandwidth, bounds a program; at 512-key chunks a batch-1 Laguna-XS step spent
# ~34 us per layer in this kernel (docs/PERFORMANCE.md), most programs idle.
_MIN_SPLIT_KEYS = 64
_MAX_SPLITS = 32
# With PDL, a program reads its metadata and the K/V of its first key tile's positions before the
# request's first query before it waits for the previous kernel (the Q/K norm + RoPE + cache
# kernel, which writes q and the K/V of the forward's own positions only): at decode those loads
# were a chain of dependent reads (query position -> key slots -> K/V) after the wait. False: the
# wait comes first (the A/B switch).
PRELOAD_OLD_KEYS = True
# ... only while a request holds at most this many query tokens a forward (None: any). At 4 (the
# K = 3 verify, the drafter block) the split loading the new keys re-loads its tile after the
# wait. That made the verify slower while attention launched only as the Q/K kernel ended (3.93
# against 3.87 ms); since the head GEMM signals attention right after its own wait
# (kernels/qkv_norm_rope_cache.py), the loads overlap the GEMM and the verify graph replays in
# 3.72 against 3.80 ms (docs/PERFORMANCE.md, fifty-seventh pass); the 8-token verify in 6.08
# against 6.20-6.22 ms, the 16-token one in 8.50 against 8.48-8.70 (fifty-eighth pass). More
# than 16 tokens: not timed.
PRELOAD_MAX_QUERIES: int | None = 16
# Split-K programs whose key chunk holds no visible key (the graph's key bucket is up to twice
# the context; sliding layers see only the window) store m and l but not their fp32 acc rows,
# and the merge reads acc only where m > -inf: at 4 query tokens a layer's partials are
# S * 4 * H * D * 4 bytes (4 MiB at 32 splits, 64 heads). Changes no value. False: the A/B.
SKIP_EMPTY_SPLITS = True
# Split-K chunks relative to the keys a program's query tile can see (its window, or the
# context up to its position), cut into S equal runs of whole tiles, instead of S chunks of the
# key axis [0, Lmax) from key 0: the key axis of a graph is its key bucket, up to twice the
# context, and a sliding layer sees only its window, so the absolute chunks left most splits
# empty and a few walking many tiles (a 16k-token context: a full layer's 16k keys in 16 splits
# of 1024, a sliding layer's 512 in one or two). The split count of a sliding layer is chosen
# from its window. Not for batch-invariant attention (its boundaries are fixed from key 0).
# Changes the summation order, not the math. False: the A/B. On the H200 (XS-2.1 size, batch-1
# decode graph; docs/PERFORMANCE.md, forty-ninth pass) at a 16k context: step 3.65 -> 2.60 ms
# (attention's span 1700 -> 619 us); 2.53 ms with the window slack below (fiftieth pass).
RELATIVE_SPLITS = True
# ... for key axes (the graph's key bucket) of at least this many keys (contexts past 2048), in
# CUDA graphs (not for fixed_splits forwards) ...
RELATIVE_MIN_KEYS = 4096
# ... or at any key length where a request holds at most this many query tokens (the decode
# step). On the H200 at a 1k context (fiftieth pass, gpu_check.sh pass51-default, the window
# slack below on): the decode step 2.25 -> 2.21 ms, but the 4-token verify graph 3.74 -> 3.81 ms
# (and goal 2's L = 4 cell 1.95x against 2.00-2.04x in earlier passes), so a verify and the
# drafter block keep the absolute chunks below RELATIVE_MIN_KEYS. In the fifty-first pass the
# same verify A/B measured 3.77 (relative) against 3.80 ms, and relative chunks in the sliding
# layers only 3.78 (drafter block 0.36 ms either way): noise-level both ways, so unchanged.
# Those rows attended different stale K/V, which moves the verify's MoE time by up to 4%; on
# identical K/V (fifty-third pass) relative chunks took 3.83 against 3.80-3.81 ms: slower.
RELATIVE_ANY_LENGTH_MAX_QUERIES = 1
# ... and a sliding layer's split count chosen from the tiles its window can span once aligned
# to whole tiles (window + query tile + one tile - 1 keys: 9-10 splits of one tile at 512)
# instead of its keys (8 splits, most of two tiles). On the H200 (fiftieth pass, gpu_check.sh
# pass51-split): at 16k 2.61 -> 2.53 ms (attention 616 -> 519 us, merge 685 -> 604 us of kernel
# time); at 1k the decode step 2.22 ms against 2.23 with absolute chunks. False: the A/B.
RELATIVE_WINDOW_SLACK = True


# batch_invariant: the keys are cut into splits of this many (from key 0, whatever the forward),
# each split's partial merged in split order; at decode the splits are the parallelism (a batch-1
# step had only KV-heads programs walking the whole context without them)
INVARIANT_SPLIT_KEYS = 128
# ... and a forward whose fp32 partials would exceed this many bytes (a long prefill: they grow
# with tokens x splits) runs in token chunks of at most this size, each a launch pair
INVARIANT_MAX_PARTIAL_BYTES = 256 << 20
# fixed_splits: only for forwards whose fp32 partials at _MAX_SPLITS splits stay within this
# many bytes (decode, verify and the drafter block of small batches: 16 MiB at 16 tokens x 64
# heads x 128); a prefill of few programs keeps the count of its keys (a chosen 2 at 512 tokens
# would otherwise become 32 and write 0.5 GiB of partials a layer)
FIXED_SPLITS_MAX_PARTIAL_BYTES = 64 << 20
# CUDA's limit on a grid's y and z sizes; the attention grid's z is query tiles x splits
MAX_GRID_Z = 65535


def _invariant_in_token_chunks(q, k_cache, v_cache, query_index, query_positions, key_slots,
                               seq_lens, out, num_splits, **kwargs):
    """:func:`paged_attention` with ``batch_invariant`` on flat-token chunks ``[c, c + n)``,
    written into ``out``. A request's queries are consecutive flat tokens
    (``query_index[i, j] = first_i + j``), so a chunk's queries of request ``i`` are at most
    ``n`` consecutive columns from ``max(0, c - first_i)``: each chunk gathers those columns
    (the others become padding, position -1) and renumbers its tokens from 0. Every query is
    computed as in one call (same tiles, same splits); only the partials' scratch
    (:data:`INVARIANT_MAX_PARTIAL_BYTES`) and the grid (:data:`MAX_GRID_Z`: ``n`` query tiles x
    ``num_splits``) are bounded. Device ops only (no host sync)."""
    t, num_heads, head_dim = q.shape
    qmax = query_index.shape[1]
    n = INVARIANT_MAX_PARTIAL_BYTES // (num_splits * num_heads * head_dim * 4)
    n = max(1, min(n, MAX_GRID_Z // num_splits, qmax))
    gate = kwargs.pop("gate")
    cols = torch.arange(n, device=query_index.device)
    for c in range(0, t, n):
        first = (c - query_index[:, :1]).clamp(min=0, max=qmax - n)  # [R, 1]
        picked = (first + cols).clamp(max=qmax - 1)  # [R, n] columns of the chunk's window
        qi = query_index.gather(1, picked)
        pos = query_positions.gather(1, picked)
        mine = (qi >= c) & (qi < c + n) & (pos >= 0)
        out[c : c + n] = paged_attention(
            q[c : c + n], k_cache, v_cache, torch.where(mine, qi - c, 0),
            torch.where(mine, pos, -1), key_slots, seq_lens,
            gate=None if gate is None else gate[c : c + n], batch_invariant=True, **kwargs)
    return out


def _block_q(qmax: int, group: int) -> int:
    return max(1, min(qmax, _TARGET_ROWS // group))


# Tile size (BLOCK_M x BLOCK_D) from which a program gets 8 warps instead of 4. The fp32
# accumulator [BLOCK_M, BLOCK_D] plus Q, a K/V tile and the logits stay in registers: from
# 64 x 128 up, 4 warps would need ~200-255 registers a thread (sm_90 build). The 4-token verify
# (BLOCK_M 32) runs 4 warps at 190 registers and twice decode's time a layer: 32 * 128 here gives
# it 8 (the A/B for the next device run: benchmarks/bench_paged_attention.py, warps=8).
WARPS8_MIN_TILE = 64 * 128


def _num_warps(block_m: int, block_d: int) -> int:
    return 8 if block_m * block_d >= WARPS8_MIN_TILE else 4


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(num_programs: int, max_keys: int, device: torch.device) -> int:
    """Split-K factor from shapes only (CUDA-graph safe): 1 unless ``num_programs`` (requests x
    KV heads x query tiles) leaves the GPU under-filled and the key axis is long; then enough
    chunks of >= ``_MIN_SPLIT_KEYS`` keys to reach about two programs per SM, at most
    ``_MAX_SPLITS``. Always 1 on CPU."""
    if device.type != "cuda":
        return 1
    target = 2 * _num_sms(device.index)
    if num_programs >= target or max_keys < 2 * _MIN_SPLIT_KEYS:
        return 1
    return max(1, min(_MAX_SPLITS, -(-target // num_programs), max_keys // _MIN_SPLIT_KEYS))


def split_plan(lmax: int, block_n: int, num_splits: int, keep_empty: bool = False) -> tuple[int, int]:
    """``num_splits`` chunks of whole ``block_n``-key tiles over ``lmax`` keys -> (the split
    count launched, keys a split). The chunks that would start past ``lmax`` are dropped unless
    ``keep_empty`` (the kernels skip a split with no keys: ``SKIP_EMPTY_SPLITS``)."""
    keys_per_split = -(-lmax // max(1, num_splits))
    split_len = -(-keys_per_split // block_n) * block_n
    return (max(1, num_splits) if keep_empty else -(-lmax // split_len)), split_len


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _new_partials(num_splits: int, t: int, num_heads: int, head_dim: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-K scratch, uninitialised: acc ``[S, T, H, D]``, m and l ``[S, T, H]``, fp32."""
    part_acc = torch.empty((num_splits, t, num_heads, head_dim), dtype=torch.float32, device=device)
    part_m = torch.empty((num_splits, t, num_heads), dtype=torch.float32, device=device)
    return part_acc, part_m, torch.empty_like(part_m)


def _check(q, k_cache, v_cache, query_index, query_positions, key_slots, seq_lens, sinks) -> None:
    if q.dim() != 3 or q.dtype not in _DTYPES:
        raise ValueError(f"q must be [T, num_heads, head_dim] fp32/bf16/fp16, got {tuple(q.shape)} {q.dtype}")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"K/V caches must be [num_slots, kv_heads, head_dim] of one shape, got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.dtype not in _DTYPES or v_cache.dtype not in _DTYPES:
        raise ValueError(f"unsupported cache dtype {k_cache.dtype} / {v_cache.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or num_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (GQA needs "
                         "num_heads % kv_heads == 0 and one head_dim)")
    if query_index.dim() != 2 or query_positions.shape != query_index.shape:
        raise ValueError("query_index / query_positions must both be [R, Qmax]")
    r = query_index.shape[0]
    if key_slots.dim() != 2 or key_slots.shape[0] != r or seq_lens.shape != (r,):
        raise ValueError(f"key_slots must be [R, Lmax] and seq_lens [R] with R = {r}")
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [{num_heads}], got {tuple(sinks.shape)}")
    tensors = [q, k_cache, v_cache, query_index, query_positions, key_slots, seq_lens]
    if sinks is not None:
        tensors.append(sinks)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all inputs of paged_attention must be on one device")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_index: torch.Tensor,
    query_positions: torch.Tensor,
    key_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    gate: torch.Tensor | None = None,
    prefetch: torch.Tensor | None = None,
    early_signal: bool = False,
    batch_invariant: bool = False,
    fixed_splits: bool = False,
) -> torch.Tensor:
    """Attention of ``T`` flat queries over the paged cache (see the module docstring for the math).

    Args:
        q: ``[T, num_heads, head_dim]`` fp32 / bf16 / fp16, any strides.
        k_cache, v_cache: ``[num_slots, kv_heads, head_dim]`` (fp32 / bf16 / fp16, any strides);
            read in q's dtype (as the reference casts them).
        query_index: ``[R, Qmax]`` int32/int64, flat token of each padded query.
        query_positions: ``[R, Qmax]`` int32/int64, absolute position (``< 0``: padding).
        key_slots: ``[R, Lmax]`` int32/int64, cache slot of key position ``j``.
        seq_lens: ``[R]`` int32/int64, visible keys per request (``<= Lmax``); any stride
            (copied when not contiguous).
        scale: logit scale (``head_dim ** -0.5`` usually).
        causal: ``j <= p`` (targets) or not (the DFlash block: all ``j < seq_len``).
        sliding_window: ``W``: ``p - W < j`` (and ``j < p + W`` when not causal), or ``None``.
        sinks: ``[num_heads]`` per-head sink logits (denominator only), rounded to q's dtype
            as the reference does, or ``None``.
        num_splits: split-K factor; ``None`` picks one from the shapes (:func:`choose_num_splits`).
        block_n: keys per tile (power of two >= 16); ``None``: 64.
        gate: ``[T, num_heads]`` per-head output-gate logits (any float dtype, any strides) or
            ``None``: the output is multiplied by ``softplus(gate)`` in the store (Laguna's
            ``out * F.softplus(g.float()).to(out.dtype)``, one kernel less per layer).
        prefetch: a weight the kernels after this one read (``o_proj``'s at decode), or
            ``None``: its bytes are prefetched into L2 by the attention programs, each a share,
            before they wait for the previous kernel (kernels/l2_prefetch.py; CUDA sm90+ and a
            contiguous, 16-byte aligned weight, else ignored). Changes no value.
        early_signal: with PDL, the attention and split-merge programs signal their dependents
            first thing, before their own wait (an exception to kernels/pdl.py rule 2), so the
            launch after the merge may be resident, loading its weight, while attention runs.
            Only for a next launch that reads nothing but weights before its own wait (the
            staged o_proj, kernels/staged_gemv.py): its wait still implies that the merge, hence
            attention, completed. Changes no value.
        batch_invariant: one launch configuration whatever ``R``, ``Qmax`` and ``Lmax``: one
            query a tile (the ``G`` heads of its group as rows), ``block_n``-key tiles from key 0, the keys
            split every :data:`INVARIANT_SPLIT_KEYS` from key 0 and the splits merged in split
            order (a power of two of splits; those past a query's keys add exact zeros), so
            each query's result is bitwise the same in decode, verify and prefill and in any
            batch (kernels/batch_invariant.py). ``num_splits`` must then be None. Long
            prefills run in token chunks (:data:`INVARIANT_MAX_PARTIAL_BYTES`).
        fixed_splits: with ``num_splits`` None, a split count of more than one becomes
            :data:`_MAX_SPLITS` chunks of whole tiles, the empty ones past ``Lmax`` kept (where
            the partials stay within :data:`FIXED_SPLITS_MAX_PARTIAL_BYTES`: few tokens): the
            launch then depends on ``Lmax`` only through a runtime argument. For forwards
            outside CUDA graphs, whose ``Lmax`` grows with every decode step: the split count
            is a constexpr of both kernels, so a count that followed ``Lmax`` built a variant
            every 64 keys (on the H200 ~1-3 s each, inside a served step; docs/PERFORMANCE.md,
            forty-second pass). Changes the summation order, not the math.

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype, contiguous. Launch shapes depend only on
        ``R, Qmax, Lmax``, the head counts and dims (CUDA-graph capturable, no host sync).
    """
    _check(q, k_cache, v_cache, query_index, query_positions, key_slots, seq_lens, sinks)
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[r] at offset r (no stride)
    t, num_heads, head_dim = q.shape
    if gate is not None and (gate.shape != (t, num_heads) or gate.device != q.device):
        raise ValueError(f"gate must be [T, num_heads] = [{t}, {num_heads}] on {q.device}, got "
                         f"{tuple(gate.shape)} on {gate.device}")
    kv_heads = k_cache.shape[1]
    r, qmax = query_index.shape
    lmax = key_slots.shape[1]
    out = torch.empty((t, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if t == 0 or r == 0 or lmax == 0:
        return out.zero_()

    group = num_heads // kv_heads
    block_n = block_n or 64
    relative = False  # RELATIVE_SPLITS below (never batch-invariant)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if batch_invariant:
        if num_splits is not None:
            raise ValueError(f"batch_invariant attention splits the keys at fixed boundaries "
                             f"({INVARIANT_SPLIT_KEYS} keys); got num_splits={num_splits}")
        # one query a tile (its GQA group's heads as the rows), for every forward: decode's
        # tile; a prefill then re-reads each key tile per query (from L2)
        block_q = 1
        split_len = max(block_n, INVARIANT_SPLIT_KEYS // block_n * block_n)
        # a power of two: few compiles (NUM_SPLITS is a constexpr); the extra splits are empty
        num_splits = _next_pow2(-(-lmax // split_len))
        if t > 1 and (num_splits * t * num_heads * head_dim * 4 > INVARIANT_MAX_PARTIAL_BYTES
                      or qmax * num_splits > MAX_GRID_Z):
            return _invariant_in_token_chunks(
                q, k_cache, v_cache, query_index, query_positions, key_slots, seq_lens, out,
                num_splits, scale=scale, causal=causal, sliding_window=sliding_window,
                sinks=sinks, block_n=block_n, gate=gate)
    else:
        block_q = _block_q(qmax, group)
        # (not for fixed_splits forwards, eager ones, whose Lmax grows a key a step: the
        # absolute chunks' kernels, which their warm-up builds, at every length)
        relative = (RELATIVE_SPLITS and not fixed_splits
                    and (lmax >= RELATIVE_MIN_KEYS or qmax <= RELATIVE_ANY_LENGTH_MAX_QUERIES))
        # keys one query tile can see: the whole axis, or its window around its block_q queries
        visible = lmax
        if relative and sliding_window is not None:
            slack = block_n - 1 if RELATIVE_WINDOW_SLACK else 0
            visible = min(lmax, (1 if causal else 2) * int(sliding_window) + block_q + slack)
        fixed = False
        if num_splits is None:
            num_splits = choose_num_splits(r * kv_heads * -(-qmax // block_q), visible, q.device)
            fixed = (fixed_splits and num_splits > 1 and _MAX_SPLITS * t * num_heads * head_dim * 4
                     <= FIXED_SPLITS_MAX_PARTIAL_BYTES)
        if relative:  # every split may hold keys; a split spans at most this many (whole tiles)
            num_splits = max(1, num_splits)  # (never fixed: relative excludes fixed_splits)
            split_len = split_plan(min(lmax, visible + block_n), block_n, num_splits, keep_empty=True)[1]
        else:
            num_splits, split_len = split_plan(lmax, block_n, _MAX_SPLITS if fixed else num_splits,
                                               keep_empty=fixed)
    split_tiles = split_len // block_n
    partials = num_splits > 1 or batch_invariant
    block_m = max(16, _next_pow2(block_q * group))
    block_d = max(16, _next_pow2(head_dim))
    q_tiles = -(-qmax // block_q)

    interpret = interpret_mode()
    use_pdl = pdl.active(q.device, interpret)
    ieee = q.dtype == torch.float32 or interpret
    window = int(sliding_window) if sliding_window is not None else 0
    if sinks is not None:
        sinks = sinks.to(q.dtype)  # the reference adds sink logits in q's dtype
    if partials:
        part_acc, part_m, part_l = _new_partials(num_splits, t, num_heads, head_dim, q.device)
    else:
        part_acc = part_m = part_l = out  # unused
    attn_kernel, merge_kernel = _kernels(interpret)
    grid = (r, kv_heads, q_tiles * num_splits)
    prefetch_plan = l2_prefetch.plan(prefetch, grid[0] * grid[1] * grid[2])
    attn_kernel[grid](
        q, k_cache, v_cache, out, sinks if sinks is not None else out,
        gate if gate is not None else out,
        query_index, query_positions, key_slots, seq_lens,
        part_acc, part_m, part_l,
        prefetch if prefetch_plan is not None else out, *(prefetch_plan or (0, 0)),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *query_index.stride(), *query_positions.stride(), *key_slots.stride(),
        *(gate.stride() if gate is not None else (0, 0)), t, qmax, split_len, float(scale) * 1.4426950408889634, window,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        HAS_GATE=gate is not None and not partials, NUM_SPLITS=num_splits, IEEE=ieee, DYNAMIC_LOOP=not interpret,
        SPLIT_TILES=split_tiles if interpret else 0,  # compiled: 0, no recompile per Lmax
        PDL=use_pdl, PREFETCH=l2_prefetch.PREFETCH_BLOCK if prefetch_plan else 0,
        PRELOAD=(PRELOAD_OLD_KEYS and not batch_invariant
                 and (PRELOAD_MAX_QUERIES is None or qmax <= PRELOAD_MAX_QUERIES)),
        EARLY_SIGNAL=early_signal and use_pdl, SKIP_EMPTY=SKIP_EMPTY_SPLITS, PARTIALS=partials,
        RELATIVE=relative, num_warps=_num_warps(block_m, block_d), num_stages=2,
        **pdl.launch_options(use_pdl),
    )
    if partials:
        merge_kernel[(t, num_heads)](
            part_acc, part_m, part_l, sinks if sinks is not None else out,
            gate if gate is not None else out, out,
            t, *out.stride(), *(gate.stride() if gate is not None else (0, 0)),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=max(2, _next_pow2(num_splits)), HAS_SINKS=sinks is not None,
            HAS_GATE=gate is not None, PDL=use_pdl, EARLY_SIGNAL=early_signal and use_pdl,
            SKIP_EMPTY=SKIP_EMPTY_SPLITS, SEQUENTIAL=batch_invariant,
            num_warps=1 if block_d <= 64 else 2, **pdl.launch_options(use_pdl),
        )
    return out
