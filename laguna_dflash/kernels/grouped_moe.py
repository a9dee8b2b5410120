"""Sorted, fixed-tile grouped MoE experts: batch-invariant and fast at large token counts (prefill).

Same math and contract as ``fused_moe.fused_moe_experts(..., reduce=False)``: for ``T`` tokens each
routed to ``k`` experts, every (token, slot) pair ``p = t*k + j`` of expert ``e = ids[t, j]`` gives

    out_pairs[t, j] = w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) )      -> [T, k, H]

with ``gate_up [E, 2I, H]`` (rows ``0..I-1`` gate, ``I..2I-1`` up) and ``down [E, H, I]``. Products
accumulate in fp32; ``h = silu(g) * u`` is rounded to ``x.dtype`` before the down projection, and
each pair's weighted output ``w * (h Wd^T)`` is computed in fp32 and rounded to ``x.dtype``.

Where ``fused_moe`` groups the pairs by expert inside every program with an O(P) counting sort
(right for decode, P <= ~256), this module groups them ONCE, with a handful of torch ops, into a
padded, expert-sorted row space, and both kernels walk fixed ``BLOCK_M``-row tiles of it:

1. :func:`align_pairs` (torch ops only: no host sync, static shapes, CUDA-graph capturable): a
   stable sort of the ``P = T*k`` flat ids; each expert's pair count padded up to a multiple of
   ``block_m``; an exclusive cumsum gives each expert's first padded row. Out come
   ``row_pair [R_MAX]`` (the pair of each padded row, ``-1`` for padding) and ``tile_expert
   [R_MAX // block_m]`` (the expert of each tile, ``-1`` past the used tiles). ``R_MAX`` is a
   bound that depends only on ``P``, ``E`` and ``block_m`` (:func:`max_tiles`), never the data.
2. ``_sorted_gate_up_kernel``, grid ``(num_tiles, cdiv(I, BLOCK_N))``: program ``(m, n)`` gathers
   the ``x`` rows of tile ``m``'s pairs (token = pair // k), streams ``BLOCK_N`` gate rows and the
   matching up rows of the tile's expert over ``K = H`` with ``tl.dot`` and writes
   ``h[row] = silu(g) * u`` for the tile's valid rows. ``h`` is kept in the padded row order
   (``[R_MAX, I]``), so the down kernel reads whole contiguous tiles of it.
3. ``_sorted_down_kernel``, grid ``(num_tiles, cdiv(H, BLOCK_N))``: the same tiles; ``h`` rows
   times ``BLOCK_N`` rows of ``down[e]`` over ``K = I``, times the pair's routing weight (fp32),
   scattered to ``out_pairs[pair]``.

Skipped pairs (``has_skipped_pairs``, expert parallelism: an id of ``-1`` is a pair whose expert is
on another rank): :func:`align_pairs` sorts them after every expert onto tiles of expert ``-1``,
which the gate_up kernel passes over (as the unused tiles) and whose pairs' rows the
``SKIP_NEGATIVE`` build of the down kernel sets to zeros; no weight is read for them.

The tile index is grid axis 0 (fastest-varying in launch order): programs that run together are
consecutive tiles of one column block, so the tiles of one expert share its weight slice in L2.

Batch invariance (kernels/batch_invariant.py) holds by construction: ``block_m``, ``BLOCK_N``,
``BLOCK_K``, warps and stages are constants (never chosen from ``T`` or ``P``); there is no
split-K and no atomic; every K loop runs from 0 upward in ``BLOCK_K`` steps; a tensor-core MMA
computes each output row from that row's inputs alone, and padding rows are exact zeros that are
never stored. So a pair's output does not depend on which other pairs share its tile, nor on its
row inside the tile: it is bitwise the same for any ``T`` and any other tokens.
"""

from __future__ import annotations

import torch

from . import pdl
from .availability import import_triton, interpret_mode, triton_can_run
from .fused_moe import ieee_block_k

triton, tl = import_triton()  # (None, None) on a CPU-only install: the module still imports
HAS_TRITON = triton is not None

__all__ = ["DEFAULT_BLOCK_M", "align_pairs", "block_m_for", "engine_block_ms", "is_available",
           "max_tiles", "sorted_moe_experts"]

DEFAULT_BLOCK_M = 16  # rows (pairs) of a tile; tl.dot needs >= 16
# (most tokens, block_m) for the engine's default (not batch-invariant) path, in order; more
# tokens take 128 rows. A tile of one expert reads its weight slice once for its rows, so fewer,
# fuller tiles read less once experts hold many pairs; short tiles leave fewer rows padded. On
# the H200 at XS-2.1 shapes (256 experts, 9 pairs a token, bf16; bench_fused_moe.py, us a layer):
# 16 / 32 / 64 rows took 469 / 471 / 497 at 256 tokens, 566 / 511 / 537 at 512 and 712 / 618 /
# 578 at 1024; 64 / 128 rows 800 / 741 at 2048, 1125 / 1130 at 4096 and 1783 / 1725 at 8192
# (docs/PERFORMANCE.md, forty-first pass); in one later call 64 / 128 rows 612 / 700 at 1280,
# 641 / 706 at 1536, 715 / 736 at 1792 and 795 / 740 at 2048 (forty-second pass).
BLOCK_M_BY_TOKENS = ((384, 16), (768, 32), (1792, 64))
LARGEST_BLOCK_M = 128

# (BLOCK_N, BLOCK_K, num_warps, num_stages) per kernel. Constants, whatever T: a pair's result must
# not depend on the batch (module docstring). Picked for H = 2048, I = 512 bf16 on an H100 / H200,
# not yet measured: gate_up streams two [BLOCK_N, BLOCK_K] weight tiles (gate and up) per K step
# (2 x 16 KiB + the 4 KiB x tile a stage at these values, 3 stages); down one [128, 64] tile.
_GATE_UP_CFG = (64, 128, 4, 3)
_DOWN_CFG = (128, 64, 4, 4)


def is_available(device: torch.device | str) -> bool:
    """True when the Triton kernels can run on ``device`` (a CUDA device, sm80+ for bf16
    ``tl.dot``, triton installed). The interpreter tests call the kernels directly."""
    return torch.device(device).type == "cuda" and triton_can_run(device, min_major=8)


def _check_block_m(block_m: int) -> None:
    if not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m!r}")


def block_m_for(num_tokens: int) -> int:
    """The tile rows :data:`BLOCK_M_BY_TOKENS` gives a call of ``num_tokens`` tokens (a shape
    alone, so a CUDA graph captures one). Not batch-invariant: the batch-invariant mode keeps
    one fixed ``block_m`` (kernels/batch_invariant.py)."""
    for max_tokens, block_m in BLOCK_M_BY_TOKENS:
        if num_tokens <= max_tokens:
            return block_m
    return LARGEST_BLOCK_M


def engine_block_ms() -> tuple[int, ...]:
    """Every tile height :func:`block_m_for` gives, ascending (the kernels' variants differ by
    it, not by the token count: what a build ahead of the first long forward covers)."""
    return tuple(sorted({block_m for _, block_m in BLOCK_M_BY_TOKENS} | {LARGEST_BLOCK_M}))


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the ``block_m``-row tiles :func:`align_pairs` can use, from the sizes alone.

    Expert ``e`` with ``c_e > 0`` pairs takes ``ceil(c_e / block_m) = floor((c_e + block_m - 1) /
    block_m)`` tiles; at most ``min(E, P)`` experts are hit and ``sum c_e = P``, and a sum of floors
    is at most the floor of the sum, so the tiles number at most
    ``floor((P + min(E, P) * (block_m - 1)) / block_m)``. The bound is reached (every expert hit
    ``1 (mod block_m)`` times, e.g. once each), so no smaller data-independent size would do.
    """
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int = DEFAULT_BLOCK_M,
                has_skipped_pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert into ``block_m``-row tiles, each tile of one expert (torch ops only).

    Args:
        ids: ``[P]`` (or any shape, flattened: pair ``p`` is flat index ``p``) integer expert ids,
            each in ``[0, num_experts)`` (not checked: that would need a host sync); with
            ``has_skipped_pairs`` also ``-1``, any number of times.
        num_experts: ``E``, the number of experts the ids index.
        block_m: rows of a tile, a power of two >= 16.
        has_skipped_pairs: ids of ``-1`` are skipped pairs: they are placed as if of an expert
            ``E`` after the real ones, on tiles whose ``tile_expert`` is ``-1``.

    Returns:
        ``(row_pair, tile_expert)``, int32, on ``ids.device``:
        ``row_pair [R_MAX]``, ``R_MAX = block_m * max_tiles(P, E', block_m)`` with ``E' = E``
        (``E + 1`` with ``has_skipped_pairs``): the pair index of each padded row, ``-1`` for
        padding. Expert ``e``'s pairs fill rows ``start_e .. start_e + c_e - 1`` in increasing
        pair order (a stable sort), its rows up to the next multiple of ``block_m`` are padding,
        ``start_e`` = sum over ``e' < e`` of ``c_e'`` rounded up to ``block_m``; rows past the
        last expert's are padding too.
        ``tile_expert [R_MAX // block_m]``: the expert of tile ``m`` (rows ``m * block_m ..``), or
        ``-1`` for the tiles past the used ones (``sum_e ceil(c_e / block_m)``) and for the
        skipped pairs' tiles (the used ones past every real expert's: they hold pairs, the
        tiles past them only padding).

    No host synchronisation and shapes from ``P``, ``E``, ``block_m`` alone: CUDA-graph capturable.
    """
    _check_block_m(block_m)
    flat = ids.reshape(-1).long()
    if has_skipped_pairs:
        # the skipped pairs as one more expert, E, sorted after the real ones: the real experts'
        # rows and tiles are those of a call without the skipped pairs, and tile_expert maps E
        # to -1 below (tiles of no weights)
        flat = torch.where(flat == -1, num_experts, flat)
        num_experts += 1
    p = flat.numel()
    num_tiles = max_tiles(p, num_experts, block_m)
    dev = flat.device
    # stable: equal ids keep their pair order; order[s] = pair at sorted position s
    sorted_ids, order = torch.sort(flat, stable=True)
    # first[e] = first sorted position of expert e (first[E] = P): counts without bincount, whose
    # CUDA version reads the largest id back to the host
    first = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=dev))
    counts = first[1:] - first[:-1]  # [E] pairs per expert
    padded = (counts + (block_m - 1)) // block_m * block_m  # rounded up to whole tiles
    pad_end = torch.cumsum(padded, 0)  # [E] one past expert e's last padded row
    pad_start = pad_end - padded  # [E] exclusive cumsum: expert e's first padded row
    # padded row of sorted position s: its expert's first row + its rank inside the expert's run
    rank = torch.arange(p, device=dev) - first[sorted_ids]
    rows = pad_start[sorted_ids] + rank
    row_pair = torch.full((num_tiles * block_m,), -1, device=dev, dtype=torch.int32)
    row_pair.scatter_(0, rows, order.to(torch.int32))  # distinct rows: no write conflicts
    # tile m's expert: the first e with pad_end[e] > m * block_m (experts with no pair have
    # pad_end equal to their predecessor's and are passed over); E (no such e): an unused tile
    tile_first_row = torch.arange(num_tiles, device=dev, dtype=pad_end.dtype) * block_m
    tile_expert = torch.searchsorted(pad_end, tile_first_row, right=True)
    real = num_experts - 1 if has_skipped_pairs else num_experts  # the skipped pairs' E -> -1 too
    tile_expert = torch.where(tile_expert < real, tile_expert, -1).to(torch.int32)
    return row_pair, tile_expert


if HAS_TRITON:
    # one [BLOCK_M, BLOCK_N] tile over the whole K, in order (fused_moe's, so the two compute alike)
    from .fused_moe import _down_tile, _gate_up_tile

    @triton.jit
    def _sorted_gate_up_kernel(
        x_ptr, w_ptr, row_pair_ptr, tile_expert_ptr, h_ptr,
        K_TOP: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # kernels/pdl.py: the tile maps (and x) are earlier kernels' outputs
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # program (m, n): tile m = padded rows r = m*BLOCK_M .. m*BLOCK_M + BLOCK_M - 1, all of
        # expert e = tile_expert[m]; for each valid row r (pair p = row_pair[r] >= 0, token
        # t = p // k) and this program's BLOCK_N columns n:
        #   h[r, n] = silu(sum_c x[t, c] Wg[n, c]) * (sum_c x[t, c] Wu[n, c])
        # with Wg = rows 0..I-1 and Wu = rows I..2I-1 of gate_up[e] (contiguous [2I, H]).
        # Invariance: a row's two dot products go over c = 0, BLOCK_K, 2*BLOCK_K, ... (fixed
        # constexpr tiling, no split-K) and an MMA output row reads only its own input row, so
        # h[r] is the same whichever pairs fill the tile's other rows.
        tile = tl.program_id(0)
        expert = tl.load(tile_expert_ptr + tile)
        # tiles past the used ones and the skipped pairs' tiles (expert -1) do nothing: the down
        # kernel reads no h row of a skipped pair (it zeroes that pair's output)
        if expert >= 0:
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(row_pair_ptr + offs_m)
            valid = pair >= 0  # padding rows: x rows of zeros, nothing stored
            tok = (tl.where(valid, pair, 0) // K_TOP).to(tl.int64)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < INTER
            w_base = w_ptr + expert.to(tl.int64) * (2 * INTER * H)
            h = _gate_up_tile(x_ptr, tok, valid, w_base, offs_n, mask_n, H, INTER,
                              BLOCK_M, BLOCK_N, BLOCK_K, IEEE)  # silu(g) * u in fp32
            rows = offs_m.to(tl.int64)
            tl.store(h_ptr + rows[:, None] * INTER + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=valid[:, None] & mask_n[None, :])

    @triton.jit
    def _sorted_down_kernel(
        h_ptr, w_ptr, row_pair_ptr, tile_expert_ptr, rw_ptr, out_ptr,
        H: tl.constexpr, INTER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr, PDL: tl.constexpr, SKIP_NEGATIVE: tl.constexpr,
    ):
        if PDL:  # kernels/pdl.py: h is the gate_up kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # program (m, n): for each valid row r of tile m (pair p = row_pair[r], expert
        # e = tile_expert[m]) and this program's BLOCK_N output columns n:
        #   out_pairs[p, n] = rw[p] * sum_j h[r, j] Wd[n, j]      (fp32, rounded at the store)
        # with Wd = down[e] (contiguous [H, I]). Same invariance argument as the gate_up kernel:
        # fixed K steps j = 0, BLOCK_K, ... and per-row MMA outputs.
        tile = tl.program_id(0)
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= 0:
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(row_pair_ptr + offs_m)
            valid = pair >= 0  # padding rows of h were never written: masked to zeros
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < H
            w_base = w_ptr + expert.to(tl.int64) * (H * INTER)
            rows = offs_m.to(tl.int64)
            acc = _down_tile(h_ptr, rows, valid, w_base, offs_n, mask_n, INTER,
                             BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
            safe_pair = tl.where(valid, pair, 0).to(tl.int64)
            rw = tl.load(rw_ptr + safe_pair, mask=valid, other=0.0).to(tl.float32)
            acc = acc * rw[:, None]
            tl.store(out_ptr + safe_pair[:, None] * H + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])
        if SKIP_NEGATIVE:
            # a tile of skipped pairs (align_pairs: expert -1 with pairs in its rows; tiles past
            # the used ones have none): their rows of out are exact zeros, read from nothing
            if expert < 0:
                pair = tl.load(row_pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
                valid = pair >= 0
                offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
                safe_pair = tl.where(valid, pair, 0).to(tl.int64)
                tl.store(out_ptr + safe_pair[:, None] * H + offs_n[None, :],
                         tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty),
                         mask=valid[:, None] & (offs_n < H)[None, :])


def sorted_moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_m: int = DEFAULT_BLOCK_M,
    has_skipped_pairs: bool = False,
) -> torch.Tensor:
    """Each (token, slot) pair's weighted expert output, batch-invariant, for any token count.

    Same contract as ``fused_moe.fused_moe_experts(..., reduce=False)``.

    Args:
        x: ``[T, H]`` fp32 / bf16 / fp16, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``).
        expert_ids: ``[T, k]`` integer expert ids in ``[0, E)``, distinct within a token (not
            range-checked: that would sync the host); with ``has_skipped_pairs`` also ``-1``, any
            number of times.
        weights: ``[T, k]`` routing weights (any float dtype; used in fp32).
        gate_up: ``[E, 2I, H]`` fused expert weights (rows gate then up), same dtype as ``x``.
        down: ``[E, H, I]`` expert down projections, same dtype as ``x``.
        block_m: pairs per tile, a power of two >= 16. A pair's output is bitwise the same for
            any ``T`` and any other tokens at one ``block_m`` (module docstring); another value
            changes the MMA shape, and may change the last bits, so keep it fixed.
        has_skipped_pairs: ids of ``-1`` are *skipped pairs* (expert parallelism: the expert is
            on another rank): a skipped pair's row is exactly zero and no expert weight is read
            for it (its tile has no expert). Each other pair's row is bitwise the one it gets
            when the skipped pairs are routed to experts of no other pair instead (its tile
            holds the same pairs in the same order). ``False`` compiles the down kernel without
            the check (the default).

    Returns:
        ``[T, k, H]`` in ``x.dtype``: ``w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)``, ``h``
        rounded to ``x.dtype`` before the down projection, the weighted product computed in fp32
        then rounded. No host synchronisation; launch shapes depend only on ``T*k``, ``E``, ``H``
        and ``I`` (CUDA-graph capturable).
    """
    _check_block_m(block_m)
    t, k = expert_ids.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    assert x.shape == (t, hidden) and down.shape == (e, hidden, inter), "shape mismatch"
    assert weights.shape == (t, k), "weights must be [T, k] like expert_ids"
    assert gate_up.dtype == x.dtype == down.dtype, "x and expert weights must share a dtype"
    assert not expert_ids.is_floating_point(), "expert_ids must be integers"
    p = t * k
    if p == 0:
        return x.new_zeros(t, k, hidden)
    if not HAS_TRITON:
        raise RuntimeError("sorted_moe_experts needs triton (a CUDA GPU, or TRITON_INTERPRET=1)")
    # the kernels address x, h, out and the expert weights as contiguous (strides from H and I)
    x = x.contiguous()
    gate_up = gate_up.contiguous()  # no-ops for the stored parameters
    down = down.contiguous()
    rw = weights.reshape(-1).contiguous()
    row_pair, tile_expert = align_pairs(expert_ids, e, block_m, has_skipped_pairs)
    num_tiles = tile_expert.numel()
    # h in the padded row order; padding rows are never written nor read
    h = torch.empty((row_pair.numel(), inter), device=x.device, dtype=x.dtype)
    out_pairs = torch.empty((t, k, hidden), device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"  # cpu: the interpreter
    use_pdl = pdl.active(x.device, interpret_mode())
    bn, bk, nw, ns = _GATE_UP_CFG
    if ieee:
        bk = ieee_block_k(bk, block_m, bn, nw, num_dots=2)  # gate and up
    _sorted_gate_up_kernel[(num_tiles, triton.cdiv(inter, bn))](
        x, gate_up, row_pair, tile_expert, h,
        K_TOP=k, H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee,
        PDL=use_pdl, num_warps=nw, num_stages=ns, **pdl.launch_options(use_pdl),
    )
    bn, bk, nw, ns = _DOWN_CFG
    if ieee:
        bk = ieee_block_k(bk, block_m, bn, nw)
    _sorted_down_kernel[(num_tiles, triton.cdiv(hidden, bn))](
        h, down, row_pair, tile_expert, rw, out_pairs,
        H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee,
        PDL=use_pdl, SKIP_NEGATIVE=bool(has_skipped_pairs), num_warps=nw, num_stages=ns,
        **pdl.launch_options(use_pdl),
    )
    return out_pairs
