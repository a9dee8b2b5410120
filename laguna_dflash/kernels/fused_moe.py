"""Fused MoE experts for small token counts (decode / verify): two Triton kernels over the experts hit.

The routed part of a Laguna MoE block, for ``T`` tokens each routed to ``k`` experts, is

    y[t] = sum_j w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, j]

with the experts stored fused: ``gate_up [E, 2I, H]`` (rows ``0..I-1`` gate, ``I..2I-1`` up) and
``down [E, H, I]``. For a verify batch (``T`` = 1..64, ``k`` = 8 of ``E`` = 256 at Laguna-XS-2.1
size) the cost is reading the weights of the distinct experts hit, so each hit expert's weights
are streamed once for all the pairs that share it:

1. Grouping by expert, inside both kernels (no torch sort, no host sync): every program loads the
   ``P = T*k`` flat expert ids (``P <= 256``, a register vector). Pair ``i``'s expert ``e`` forms a
   *run* = all pairs with id ``e``; pair ``i`` OWNS the run when it is the first of them. A
   member's rank inside the run is a prefix count, so the ``m``-th member's pair index is
   ``sum_p p * [id_p == e and rank_p == m]``. This is a stable counting sort done per program.
2. ``_gate_up_kernel``: grid ``(P, ceil(I / BLOCK_N))``. Program ``(i, n)``, if pair ``i`` owns
   its run, loads the run's token rows of ``x`` and streams ``BLOCK_N`` gate rows and the
   matching ``BLOCK_N`` up rows of expert ``e`` ONCE for the whole run (a run holds at most ``T``
   pairs: top-k ids are distinct per token), writing ``h[p] = silu(x Wg^T) * (x Wu^T)``.
   Programs whose pair does not own its run (a duplicate expert) do nothing.
3. ``_down_kernel``: the same grid over pairs and ``BLOCK_N`` columns of ``H``; computes
   ``w[p] * (h[p] Wd^T)`` in fp32 and writes it to ``out_pairs[p]`` (``[T, k, H]``).
4. ``out_pairs.sum(1)``: a deterministic reduction over ``k`` (no atomics).

Skipped pairs (``has_skipped_pairs``, expert parallelism: an id of ``-1`` is a pair whose expert is
on another rank): in the ``SKIP_NEGATIVE`` build a skipped pair's program returns before the
grouping (the pairs of id -1 are no run, and are in no expert's run), and its down program stores
its row of zeros; no weight is read for it. The default build has no such check.

Grids depend only on ``P`` and the shapes, never on the data, so the call is CUDA-graph capturable;
the host side is two allocations, two launches and one sum (launch overhead matters in eager mode).
Products accumulate in fp32; ``h`` and each pair's weighted output are rounded to ``x.dtype``, as
in the torch path. The routed scaling factor and the shared expert stay with the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .availability import import_triton, interpret_mode, triton_can_run

triton, tl = import_triton()  # (None, None) on a CPU-only install: the module still imports
HAS_TRITON = triton is not None


def moe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    has_skipped_pairs: bool = False,
) -> torch.Tensor:
    """Pure-torch routed experts, with exactly the semantics (and rounding) of ``MoE.experts_forward``.

    Args:
        x: ``[T, H]`` activations (fp32 / bf16 / fp16).
        expert_ids: ``[T, k]`` int64 expert index per (token, slot) in ``[0, E)``, distinct
            within a token; with ``has_skipped_pairs`` also ``-1`` (any number of times).
        weights: ``[T, k]`` routing weights, in ``x.dtype``.
        gate_up: ``[E, 2I, H]`` fused expert weights, rows gate then up.
        down: ``[E, H, I]`` expert down projections.
        has_skipped_pairs: pairs of id ``-1`` are skipped (expert parallelism: their expert is
            on another rank): they add nothing and index no weight.

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)`` over
        the pairs not skipped (without the routed scaling factor). Pairs are visited in stable
        expert order and each expert's contribution is rounded to ``x.dtype`` before it is added,
        like the torch path. Syncs the host (a reference, not for CUDA graphs).
    """
    t, k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    if has_skipped_pairs:
        # -1 sorts first: drop those positions, the rest keep their stable expert order
        order = order[int((flat_ids == -1).sum()):]
        flat_ids = flat_ids[flat_ids != -1]
    token_of = order // k
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    w_sorted = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        gate, up = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, (h * w_sorted[start : start + count, None]).to(out.dtype))
        start += count
    return out


def is_available(device: torch.device | str) -> bool:
    """True when the Triton kernels can run on ``device`` (a CUDA device, sm80+ for bf16
    ``tl.dot``, triton installed). The interpreter tests call the kernels directly."""
    return torch.device(device).type == "cuda" and triton_can_run(device, min_major=8)


def _block_m(max_run: int) -> int:
    """Rows per tile: a run holds at most ``T`` pairs; tl.dot needs >= 16."""
    return max(16, min(64, triton.next_power_of_2(max_run)))


if HAS_TRITON:

    @triton.jit
    def _own_run(ids_ptr, i, P, P_PAD: tl.constexpr):
        """The run of pair ``i``'s expert ``e``: all pairs ``p < P`` with ``ids[p] == e``.

        Pair ``i`` OWNS the run when it is the first such pair (``min{p : ids[p] == e} == i``);
        count is 0 otherwise, so each hit expert is processed by exactly one program row.
        Returns (expert, count, same [P_PAD] mask of the run's pairs, rank [P_PAD] of each pair
        inside the run = exclusive prefix count of ``same``).
        """
        offs = tl.arange(0, P_PAD)
        valid = offs < P
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
        expert = tl.load(ids_ptr + i)
        same = valid & (ids == expert)
        first = tl.min(tl.where(same, offs, P_PAD), 0)
        count = tl.sum(same.to(tl.int32), 0)
        count = tl.where(first == i, count, 0)
        rank = tl.cumsum(same.to(tl.int32), 0) - 1
        return expert, count, same, rank

    @triton.jit
    def _run_rows(same, rank, count, m0, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr):
        """Pair indices of the run's members ``m0 .. m0+BLOCK_M-1`` (by rank) and their mask:
        ``pair[m] = sum_p p * [same_p & rank_p == m0 + m]``."""
        offs_r = m0 + tl.arange(0, BLOCK_M)
        offs_p = tl.arange(0, P_PAD)
        sel = same[None, :] & (rank[None, :] == offs_r[:, None])  # [BLOCK_M, P_PAD]
        pair = tl.sum(tl.where(sel, offs_p[None, :], 0), 1)
        return pair, offs_r < count

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr):
        """``acc + a @ b`` in fp32. IEEE: exact fp32 products (fp32 inputs, where the default would
        be tf32; and the CPU interpreter, whose bf16 tl.dot is wrong in triton 3.6)."""
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _gate_up_tile(x_ptr, tok, mask_m, w_base, offs_n, mask_n, H: tl.constexpr,
                      INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """``[BLOCK_M, BLOCK_N]`` fp32 ``silu(x Wg^T) * (x Wu^T)`` for the x rows ``tok``
        (``mask_m``: the valid ones; the others are zeros) and the columns ``offs_n`` of one
        expert's ``gate_up`` at ``w_base`` (gate rows 0..I-1, up rows I..2I-1, H contiguous).
        K runs 0, BLOCK_K, 2 BLOCK_K, ... with no split, and an MMA output row reads only its own
        input row: a row's value does not depend on the tile's other rows (this kernel's and
        kernels/grouped_moe.py's batch invariance)."""
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, H, BLOCK_K):
            offs_c = c0 + tl.arange(0, BLOCK_K)
            mask_c = offs_c < H
            xa = tl.load(x_ptr + tok[:, None] * H + offs_c[None, :],
                         mask=mask_m[:, None] & mask_c[None, :], other=0.0)
            # [BLOCK_K, BLOCK_N] views of gate rows n and up rows I + n (H contiguous)
            wmask = mask_c[:, None] & mask_n[None, :]
            wg = tl.load(w_base + offs_n[None, :] * H + offs_c[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (offs_n[None, :] + INTER) * H + offs_c[:, None],
                         mask=wmask, other=0.0)
            acc_g = _mma(xa, wg, acc_g, IEEE)
            acc_u = _mma(xa, wu, acc_u, IEEE)
        return acc_g * tl.sigmoid(acc_g) * acc_u  # silu(g) = g * sigmoid(g)

    @triton.jit
    def _down_tile(h_ptr, h_rows, mask_m, w_base, offs_n, mask_n, INTER: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
        """``[BLOCK_M, BLOCK_N]`` fp32 ``h Wd^T`` for the h rows ``h_rows`` (``mask_m``: the
        valid ones) and the columns ``offs_n`` of one expert's ``down`` at ``w_base`` (I
        contiguous); K in order with no split, as :func:`_gate_up_tile`."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, INTER, BLOCK_K):
            offs_c = c0 + tl.arange(0, BLOCK_K)
            mask_c = offs_c < INTER
            ha = tl.load(h_ptr + h_rows[:, None] * INTER + offs_c[None, :],
                         mask=mask_m[:, None] & mask_c[None, :], other=0.0)
            # [BLOCK_K, BLOCK_N] view of the down rows n (I contiguous)
            wd = tl.load(w_base + offs_n[None, :] * INTER + offs_c[:, None],
                         mask=mask_c[:, None] & mask_n[None, :], other=0.0)
            acc = _mma(ha, wd, acc, IEEE)
        return acc

    @triton.jit
    def _gate_up_kernel(
        x_ptr, w_ptr, ids_ptr, h_ptr, P,
        K_TOP: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
        P_PAD: tl.constexpr, M_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        SKIP_NEGATIVE: tl.constexpr,
    ):
        if PDL:  # kernels/pdl.py: the ids and x are earlier kernels' outputs
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if SKIP_NEGATIVE:
            # a skipped pair (id -1) owns no run and is in no other: the -1 "run" (up to P pairs,
            # beyond the T rows that M_TILES covers) is never computed; its h rows stay unwritten
            if tl.load(ids_ptr + tl.program_id(0)) < 0:
                return
        # program (i, n): if pair i owns its expert e's run, for every pair p of the run
        #   h[p, n] = silu(sum_c x[tok(p), c] Wg[n, c]) * (sum_c x[tok(p), c] Wu[n, c])
        # over this program's BLOCK_N columns n; Wg = rows 0..I-1, Wu = rows I..2I-1 of
        # gate_up[e] (I = INTER, contiguous [2I, H]); tok(p) = p // k. Each weight tile is read
        # once for the whole run.
        expert, count, same, rank = _own_run(ids_ptr, tl.program_id(0), P, P_PAD)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < INTER
        w_base = w_ptr + expert.to(tl.int64) * (2 * INTER * H)
        # a run holds <= T pairs (top-k ids are distinct per token), so M_TILES = cdiv(T, BLOCK_M)
        # tiles cover it; a static trip count (the interpreter cannot loop to a reduced value).
        # Tiles past the run are skipped, so programs owning no run read no weights.
        for mt in range(M_TILES):
            if mt * BLOCK_M < count:
                pair, mask_m = _run_rows(same, rank, count, mt * BLOCK_M, BLOCK_M, P_PAD)
                h = _gate_up_tile(x_ptr, pair // K_TOP, mask_m, w_base, offs_n, mask_n, H, INTER,
                                  BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
                tl.store(h_ptr + pair[:, None] * INTER + offs_n[None, :],
                         h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _down_kernel(
        h_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr, P,
        H: tl.constexpr, INTER: tl.constexpr,
        P_PAD: tl.constexpr, M_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        SKIP_NEGATIVE: tl.constexpr,
    ):
        if PDL:  # kernels/pdl.py: h is the gate_up kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if SKIP_NEGATIVE:
            # a skipped pair (id -1) is in no run, so its own program writes its row: exact
            # zeros, no weight or h read (no other program stores to it)
            i = tl.program_id(0)
            if tl.load(ids_ptr + i) < 0:
                offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(out_ptr + i.to(tl.int64) * H + offs_n,
                         tl.zeros([BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=offs_n < H)
                return
        # program (i, n): if pair i owns its expert e's run, for every pair p of the run
        #   out_pairs[p, n] = rw[p] * sum_j h[p, j] Wd[n, j]     (fp32 accumulate)
        # over this program's BLOCK_N output columns n; Wd = down[e] (contiguous [H, I]).
        expert, count, same, rank = _own_run(ids_ptr, tl.program_id(0), P, P_PAD)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        w_base = w_ptr + expert.to(tl.int64) * (H * INTER)
        for mt in range(M_TILES):
            if mt * BLOCK_M < count:
                pair, mask_m = _run_rows(same, rank, count, mt * BLOCK_M, BLOCK_M, P_PAD)
                acc = _down_tile(h_ptr, pair, mask_m, w_base, offs_n, mask_n, INTER,
                                 BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
                rw = tl.load(rw_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
                acc = acc * rw[:, None]
                tl.store(out_ptr + pair[:, None] * H + offs_n[None, :],
                         acc.to(out_ptr.dtype.element_ty),
                         mask=mask_m[:, None] & mask_n[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) per kernel, from a sweep on an H200 (bench_fused_moe
# --sweep): the kernels are memory-bound, and these tiles keep enough programs (runs x column
# blocks) in flight for a single token while staying best at 16 tokens.
_GATE_UP_CFG = (32, 128, 4, 4)
_DOWN_CFG = (64, 128, 4, 4)

# An fp32 ("ieee") tl.dot is lowered to FMAs, all unrolled in the PTX: BLOCK_M * BLOCK_N *
# BLOCK_K / threads of them a thread for each dot of a K step. At 4096 (BLOCK_M 64, BLOCK_K 128)
# ptxas ran for minutes a kernel on the H200's host, which stalled the float32 engine's start-up
# capture past 5 minutes (2026-12-02); at 1024 a kernel builds in about a second.
MAX_IEEE_FMAS_PER_THREAD = 1024


def ieee_block_k(block_k: int, block_m: int, block_n: int, num_warps: int, num_dots: int = 1) -> int:
    """``block_k`` for a build whose ``num_dots`` dots a K step (``[block_m, block_k] @
    [block_k, block_n]`` each) run as fp32 FMAs: halved until a thread's FMAs a K step are at
    most MAX_IEEE_FMAS_PER_THREAD, and at least 16 (tl.dot's minimum). Only the K step changes:
    every K loop still runs in order from 0."""
    threads = 32 * num_warps
    while block_k > 16 and num_dots * block_m * block_n * block_k > MAX_IEEE_FMAS_PER_THREAD * threads:
        block_k //= 2
    return block_k


def fused_moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    reduce: bool = True,
    block_m: int | None = None,
    max_tokens: int | None = None,
    has_skipped_pairs: bool = False,
) -> torch.Tensor:
    """Routed experts with two Triton kernels; same contract as :func:`moe_experts_reference`.

    Args:
        x: ``[T, H]`` fp32 / bf16 / fp16, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``).
        expert_ids: ``[T, k]`` integer expert ids in ``[0, E)``, distinct within a token (not
            range-checked: that would sync the host); with ``has_skipped_pairs`` also ``-1``,
            any number of times.
        weights: ``[T, k]`` routing weights (any float dtype; used in fp32).
        gate_up: ``[E, 2I, H]`` (last dim contiguous), same dtype as ``x``.
        down: ``[E, H, I]`` (last dim contiguous), same dtype as ``x``.

        reduce: sum over the ``k`` pairs of each token here (``False``: return the pairs, for
            a caller that fuses the sum with what follows).
        block_m: pairs per tile (a power of two >= 16); ``None``: from ``T`` (16 .. 64). A fixed
            value makes each pair's result independent of ``T`` (kernels/batch_invariant.py).
        max_tokens: size the kernels' static tile loop for up to this many tokens (>= T)
            instead of ``T``, so calls of different ``T`` share one compile; ``None``: ``T``.
        has_skipped_pairs: ids of ``-1`` are *skipped pairs* (expert parallelism: the expert is
            on another rank): a skipped pair's row of ``[T, k, H]`` is exactly zero (it adds
            nothing to the ``reduce`` sum) and no expert weight is read for it. Each other
            pair's row is bitwise the one it gets when the skipped pairs are routed to experts
            of no other pair instead (its run is the same). ``False`` compiles the kernels
            without the check (the tuned default).

    Returns:
        ``[T, H]`` in ``x.dtype`` (``[T, k, H]``, each pair's weighted output, when not
        ``reduce``). No host synchronisation; launch shapes depend only on ``T*k``, ``E``, ``H``
        and ``I`` (CUDA-graph capturable).
    """
    t, k = expert_ids.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    assert x.shape == (t, hidden) and down.shape == (e, hidden, inter), "shape mismatch"
    assert gate_up.dtype == x.dtype == down.dtype, "x and expert weights must share a dtype"
    p = t * k
    if p == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(t, k, hidden)
    # the kernels address x, h, out and the expert weights as contiguous (strides from H and I)
    x = x.contiguous()
    gate_up = gate_up.contiguous()  # no-ops for the stored parameters
    down = down.contiguous()
    ids = expert_ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    h = torch.empty((p, inter), device=x.device, dtype=x.dtype)
    # each pair's weighted expert output, rounded to x.dtype like the torch path's contributions
    out_pairs = torch.empty((t, k, hidden), device=x.device, dtype=x.dtype)
    p_pad = triton.next_power_of_2(p)
    if block_m is None:
        block_m = _block_m(t)
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if max_tokens is not None and max_tokens < t:
        raise ValueError(f"max_tokens={max_tokens} is below the {t} tokens given")
    m_tiles = triton.cdiv(max_tokens or t, block_m)  # tiles past a run are skipped at run time
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"  # cpu: the interpreter
    use_pdl = pdl.active(x.device, interpret_mode())
    bn, bk, nw, ns = _GATE_UP_CFG
    if ieee:
        bk = ieee_block_k(bk, block_m, bn, nw, num_dots=2)  # gate and up
    _gate_up_kernel[(p, triton.cdiv(inter, bn))](
        x, gate_up, ids, h, p,
        K_TOP=k, H=hidden, INTER=inter,
        P_PAD=p_pad, M_TILES=m_tiles, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee,
        PDL=use_pdl, SKIP_NEGATIVE=bool(has_skipped_pairs), num_warps=nw, num_stages=ns,
        **pdl.launch_options(use_pdl),
    )
    bn, bk, nw, ns = _DOWN_CFG
    if ieee:
        bk = ieee_block_k(bk, block_m, bn, nw)
    _down_kernel[(p, triton.cdiv(hidden, bn))](
        h, down, ids, rw, out_pairs, p,
        H=hidden, INTER=inter,
        P_PAD=p_pad, M_TILES=m_tiles, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee,
        PDL=use_pdl, SKIP_NEGATIVE=bool(has_skipped_pairs), num_warps=nw, num_stages=ns,
        **pdl.launch_options(use_pdl),
    )
    # deterministic reduction over the k slots of each token (fp32 accumulation inside torch)
    return out_pairs.sum(dim=1) if reduce else out_pairs
