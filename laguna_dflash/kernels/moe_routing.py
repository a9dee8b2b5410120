"""MoE routing in one Triton launch: scores, biased top-k, gather, renormalise, scale; and the
same with the router GEMM in front, also in one launch (:func:`fused_router_route`).

For router logits ``z [T, E]`` (the router GEMM's output), per token ``t``, all in fp32::

    z   = logits[t].float()
    z   = tanh(z / softcap) * softcap               if softcap > 0
    s   = sigmoid(z)          or  sqrt(softplus(z))  (torch softplus: beta 1, threshold 20)
    ids = top_k of (s + bias), in descending order (ties: the lower expert index first)
    w   = s[ids]                                    (the UNBIASED scores)
    w   = w / sum(w)                                if norm_topk_prob
    w   = w * scale

``weights = w.to(logits.dtype)`` and ``ids`` (int64) come back as ``[T, top_k]``; with
``num_shared=1`` one more column per token holds id ``E`` (where a caller stacks the shared
expert after the routed ones) with weight exactly 1.0, so ``[T, top_k + 1]``. This is
``fusion.moe_route`` (the torch reference), plus the routed scaling factor and the shared column.

Why: eagerly the torch chain is about five kernels (sigmoid, ``torch.topk`` = gatherTopK and a
bitonic sort, gather, renormalise) and more for the scale and the shared column; at decode each
costs a few microseconds of GPU time whatever its size. Here it is ONE launch, grid ``(T,)``:

* program ``t`` loads its ``E`` logits as a vector padded to ``BLOCK_E = next_pow2(E)`` (masked;
  ``E <= 1024``) and computes ``s`` and the selection key ``s + bias``;
* selection packs each key into one int64, ``(monotone int32 of the fp32 key) << 32 |
  (BLOCK_E - 1 - e)``, so the keys are distinct and the larger of two equal scores is the lower
  index (bf16 / fp16 logits: ``... << 32 | (BLOCK_E - 1 - e) << 16 | the logit's 16 bits``, so
  the chosen logit comes out of the selected key; ``PACK_LOGITS``). The top keys, in descending
  order, come from one bitonic top-k (``tl.topk``, ``TOPK_BITONIC``; on the H200 the fused router
  took 3.13 against 4.26 us a layer at T = 1) or from ``top_k`` steps of "max-reduce, decode the
  index, mask that lane out": the same keys in the same order. Padding lanes hold a sentinel
  below every real key (``-inf`` included, so an expert whose bias is ``-inf`` is still picked
  before a padding lane). A NaN key is treated as ``+inf`` (torch.topk ranks NaN first);
* the ``top_k`` chosen logits (unpacked, or for fp32 re-read, cache-hot) get their scores recomputed, then
  normalised, scaled, rounded to the output dtype and stored with the ids in one vector store.

The routing math lives in shared ``@triton.jit`` helpers (``_scores``, ``_select_top_k``,
``_route_weights``, ``_store_routes``) over ``[ROWS, BLOCK_E]`` tiles of tokens: one row a
program here, up to 16 rows in the fused kernel below; ONE implementation for both.

No host synchronisation, and the launch depends only on the shapes and flags (CUDA-graph
capturable); ``softcap`` and ``scale`` are runtime arguments, not compile-time constants.

Precision: tanh is computed from ``exp`` (libdevice's tanh returns None under Triton's CPU
interpreter in triton 3.6), as Cephes' ``tanhf`` does: an odd polynomial for ``|x| < 0.625``,
``1 - 2 / (exp(2|x|) + 1)`` above (within 2 fp32 ulp of torch.tanh, measured). ``log1p(u)`` for softplus is
``log(1 + u) * u / ((1 + u) - 1)`` (exact to a few ulp with an accurate ``log``, which ``tl.log``
is). Divisions and the square root are correctly rounded (``div_rn``, ``sqrt_rn``) as torch's
(plain ``/`` and ``tl.sqrt`` compile to approximate PTX instructions).
bf16 results are rounded to nearest even on the bits before the store, because the interpreter's
fp32 -> bf16 cast truncates (compiled, the store's cast would round the same way).
With ``kernels.pdl.USE_PDL`` (on by default) the kernel uses programmatic dependent launch:
the bias is loaded before it waits for the router GEMM's logits (kernels/pdl.py).

Router GEMM fused (:func:`fused_router_route`)
----------------------------------------------
``fused_router_route(x, W, bias, ...) == fused_moe_route(F.linear(x, W), bias, ...)`` for
``x [T, H]`` (``1 <= T <= 16``; fp32 / bf16 / fp16, any row stride, unit column stride) and
``W [E, H]`` contiguous of x's dtype: the logits ``z[t, e] = sum_k x[t, k] W[e, k]`` accumulate in
fp32 and are rounded ONCE to x.dtype (round to nearest even, on the bits: ``jit._round_to``)
exactly where ``F.linear``'s output is, then routed as above. At batch-1 decode the router GEMM
(~3 us) and the routing kernel are each a launch, and a kernel boundary costs ~1-2 us even with
PDL; this is one launch.

* Grid ``(ceil(E / BLOCK_N), SPLIT_K)``: program ``(j, s)`` owns experts ``[j BLOCK_N, (j + 1)
  BLOCK_N)`` and the K chunk ``[s Kc, (s + 1) Kc)``, ``Kc = K_STEPS * BLOCK_K``. ``BLOCK_K`` is one
  warp's 32 lanes x 16 bytes (256 bf16 / 128 fp32), and warps take expert rows, so every K
  reduction is in-thread adds plus warp shuffles (no shared memory). SPLIT_K grows until about
  ``RouterConfig.programs`` (128) programs run, ``K_STEPS <= 4``: for Laguna (E = 256, H = 2048,
  bf16) 32 x 4 = 128 programs, each 8 experts x 512 of K (the skinny GEMM's measured shape,
  ``kernels/skinny_gemm.py``).
* A program loads its whole weight slab ``[BLOCK_N, K_STEPS, BLOCK_K]`` (``evict_first``: read
  once) BEFORE ``griddepcontrol.wait``: weights are parameters (pdl.py rule 3), so with PDL the
  1 MiB stream overlaps the previous kernel's tail. After the wait it loads x (the previous
  kernel's output) ``X_GROUP`` rows at a time in the weight tile's layout (stride 0 along the
  experts: no shuffle; the rows' L2 latencies overlap), multiplies in fp32 and stores its fp32
  partial logits ``part[s, t, e]`` (workspace ``[SPLIT_K, 16, E]``), then signals
  ``launch_dependents``.
* Semaphore (the skinny GEMM's split-K pattern): CTA barrier, then one ``acq_rel`` gpu-scope
  atomic add on a single arrival counter. The program that sees ``#programs - 1`` arrived last:
  it sums each logit's ``SPLIT_K`` partials from L2 (``.cg``) IN SPLIT ORDER (so the result does
  not depend on which program came last: bitwise reproducible), rounds to x.dtype, routes
  ``ROUTE_ROWS`` tokens at a time with the shared helpers (the chosen experts' logits come out of
  the packed top-k key; fp32 ones are the same sums of the same partials, read again: one more
  dependent L2 round trip), stores weights and ids, and resets the counter to 0
  (relaxed exchange). The partials need no reset: a call overwrites every slab entry it reads.
  No memset launch, no host sync: CUDA-graph capturable and replayable.
* The workspace (partials and the counter, zeroed once) is cached per ``(device, E, SPLIT_K)``
  and never freed (graphs point at it). Make the first call of a shape outside a graph capture;
  two calls with the same key must not run concurrently on different streams.

Equal rounded logits give bitwise equal ids and (but for ``norm_topk_prob``'s fp32 sum, whose
order follows each kernel's tile layout on the GPU: 1 ulp) weights to the two-kernel path. The
logits themselves may differ by one ulp of x.dtype where the fp32 sums of the two GEMMs (different
orders) straddle a rounding boundary; with fp32-exact inputs they are bitwise equal (tested).
The last program routes every token alone, so the fusion pays for few tokens only: on the H200
4.3 vs 5.1 us per layer at T = 1, about even at T = 4, slower from T = 8 on (the numbers are
at ``_ROUTER_CONFIG_FEW``; ``models.layers.MoE.fused_router_max_tokens`` draws the line).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import jit as _jit
from . import l2_prefetch, pdl
from .availability import import_triton, interpret_mode, triton_can_run
from .jit import DTYPE_CODE, jit_functions
from .precompile import register_state

triton, tl = import_triton()  # (None, None) on a CPU-only install: the module still imports
HAS_TRITON = triton is not None

__all__ = [
    "MAX_EXPERTS",
    "MAX_ROUTER_TOKENS",
    "SCORE_FUNCS",
    "RouterConfig",
    "can_fuse_router",
    "default_router_config",
    "fused_moe_route",
    "fused_router_route",
    "is_available",
]

MAX_EXPERTS = 1024
MAX_ROUTER_TOKENS = 16  # tokens of fused_router_route (rows of its partial-logit workspace)
SCORE_FUNCS = ("sigmoid", "sqrtsoftplus")
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# bf16 / fp16 logits ride in the low bits of the top-k key (_select_top_k), so the routing reads
# the chosen experts' logits without a second dependent load; False: re-read them (an A/B switch).
# Only where a program routes one token at a time (the routing kernel; the fused router at
# decode): on the H200 (XS-2.1 size, batch 1) the fused router's span fell from 193 to 183 us a
# decode replay (step 2.39 -> 2.36 ms), but rose from 228 to 244 us in the 4-token verify graph,
# whose routing tiles carry 4 tokens (docs/PERFORMANCE.md, twelfth pass).
PACK_LOGITS = True
# The top-k keys come from one bitonic top-k (``tl.topk``) of next_pow2(top_k) keys, repeated to
# fill the K_PAD columns; False: TOP_K dependent max-reductions over the row (each a cross-warp
# reduction). The same ids, logits and order either way (the packed keys are distinct). On the
# H200 (E = 256, top-8, bf16; bench_router_route.py) the fused router took 3.13 against 4.26 us a
# layer at T = 1 and 4.87 against 5.79 at T = 4; the decode graph replayed in 2.14 against 2.15 ms
# and the 4-token verify graph in 3.82 against 3.84 (docs/PERFORMANCE.md, sixteenth pass: a
# top-k of all K_PAD keys measured between the two and was removed).
TOPK_BITONIC = True
# Lanes a program of the fused router that issue its share of an L2 prefetch
# (``fused_router_route(prefetch=...)``; kernels/l2_prefetch.py): a few large TMA bulk prefetches
# a program rather than one small one per thread, so issuing them costs the program little.
PREFETCH_LANES = 2
# Where the router's programs issue that prefetch: 0 before their PDL wait (right after their own
# weight tile's loads), 1 just after the wait, 2 after their arrival at the semaphore (every
# program but the last, which routes). On an H100 (XS-2.1 decode graph, a 16 MB tail of the next
# Q|K|V|gate weight) 2.40, 2.42 and 2.36 ms a replay against 2.41-2.42 without: before or just
# after the wait, the prefetch's traffic delays the router's own loads (docs/PERFORMANCE.md,
# seventy-eighth pass).
PREFETCH_AT = 2


def _pack_dtype(dtype: torch.dtype) -> int:
    # the PACK_DTYPE constexpr: the dtype code of 16-bit logits when packed, else 0
    return DTYPE_CODE[dtype] if PACK_LOGITS and dtype != torch.float32 else 0


def is_available(device: torch.device | str) -> bool:
    """Whether :func:`fused_moe_route` can run on ``device``: triton importable and either a CUDA
    device of compute capability >= 8.0, or a CPU under ``TRITON_INTERPRET=1``."""
    return triton_can_run(device, min_major=8)


if HAS_TRITON:
    _prefetch_l2_lanes = l2_prefetch.prefetch_lanes_function()  # the router's L2 prefetch


    @triton.jit
    def _tanh(x):
        # Cephes tanhf: odd polynomial below 0.625, 1 - 2 / (e^{2|x|} + 1) above (1.0 in fp32 from
        # |x| ~ 9.1 on, so clamping at 20 only keeps exp finite); the sign restored last. NaN stays
        # NaN.
        a = tl.abs(x)
        e2a = tl.exp(2.0 * tl.where(a > 20.0, 20.0, a))  # NaN kept
        big = 1.0 - tl.math.div_rn(tl.full(a.shape, 2.0, tl.float32), e2a + 1.0)
        s = a * a
        p = (((-5.70498872745e-3 * s + 2.06390887954e-2) * s - 5.37397155531e-2) * s
             + 1.33314422036e-1) * s - 3.33332819422e-1
        small = p * s * a + a
        t = tl.where(a < 0.625, small, big)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _scores(z, softcap, HAS_SOFTCAP: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr):
        # fp32 logits -> router scores s (see the module docstring)
        if HAS_SOFTCAP:
            cap = tl.full(z.shape, 1.0, tl.float32) * softcap
            z = _tanh(tl.math.div_rn(z, cap)) * softcap
        if SQRT_SOFTPLUS:
            u = tl.exp(tl.where(z > 20.0, 20.0, z))  # softplus(z) = z above 20: exp stays finite
            w = 1.0 + u
            # log1p(u) = log(w) * u / (w - 1); u / 0 when w == 1 is dropped by the where()
            log1p = tl.where(w == 1.0, u, tl.log(w) * tl.math.div_rn(u, w - 1.0))
            s = tl.math.sqrt_rn(tl.where(z > 20.0, z, log1p))
        else:
            s = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))
        return s

    # fp32 -> the nearest value of the output dtype (round to nearest even, on the bits for bf16:
    # the interpreter's fp32 -> bf16 cast truncates); shared with the skinny GEMM (kernels/jit.py)
    _round_to = jit_functions(__name__, (_jit._round_to,))["_round_to"]

    # ---- the routing math, shared by both kernels: ROWS tokens at a time, [ROWS, BLOCK_E] tiles

    @triton.jit
    def _unpack_keys(key, BLOCK_E: tl.constexpr, PACK_DTYPE: tl.constexpr):
        # packed selection keys (any shape, _select_top_k's layout) -> (expert index int32, the
        # logit the key carries as fp32; zeros when PACK_DTYPE is 0: fp32 logits are not packed)
        if PACK_DTYPE == 0:
            idx = BLOCK_E - 1 - (key & (BLOCK_E - 1)).to(tl.int32)
            z = (key & 0).to(tl.float32)
        else:
            idx = BLOCK_E - 1 - ((key >> 16) & (BLOCK_E - 1)).to(tl.int32)
            low = (key & 0xFFFF).to(tl.int32)
            if PACK_DTYPE == 1:
                z = (low << 16).to(tl.float32, bitcast=True)
            else:
                z = low.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return idx, z

    @triton.jit
    def _select_top_k(key, z, valid, offs, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
                      K_PAD: tl.constexpr, PACK_DTYPE: tl.constexpr, BITONIC: tl.constexpr,
                      SEL_K: tl.constexpr):
        # key [ROWS, BLOCK_E] fp32 (s + bias), z the fp32 logits, valid / offs [1, BLOCK_E] ->
        # (ids [ROWS, K_PAD] int32, columns >= TOP_K: 0; the chosen logits z_sel [ROWS, K_PAD]
        # fp32 when PACK_DTYPE is a 16-bit dtype code, else zeros for the caller to read).
        # Order-preserving int32 of the fp32 key (negative floats: flip the magnitude bits) in the
        # high half, BLOCK_E - 1 - e in the low half (bits 16-31 when packing, bits 0-15 then
        # carry the logit's 16-bit pattern), so max() prefers the lower index on ties and brings
        # the chosen logit along: no dependent re-read of the logits after the selection. The
        # sentinel is below (monotone(-inf) << 32): padding and taken lanes.
        key = tl.where(key != key, float("inf"), key)  # NaN ranks first, as in torch.topk
        bits = key.to(tl.int32, bitcast=True)
        mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        rev = (BLOCK_E - 1 - offs).to(tl.int64)
        if PACK_DTYPE == 1:  # bf16 value held in fp32: the high 16 bits
            zb = (z.to(tl.uint32, bitcast=True) >> 16).to(tl.int64)
            packed = (mono << 32) | (rev << 16) | zb
        elif PACK_DTYPE == 2:  # fp16
            zb = z.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
            packed = (mono << 32) | (rev << 16) | zb
        else:
            packed = (mono << 32) | rev
        packed = tl.where(valid, packed, -9223372036854775807)
        kk = tl.arange(0, K_PAD)[None, :]
        # the bitonic top-k needs at least 2 keys to select (SEL_K = next_pow2(TOP_K) <= BLOCK_E)
        if BITONIC and SEL_K >= 2:
            # the SEL_K largest keys of each row, descending, in one bitonic top-k (triton's
            # tl.topk: log2 rounds of compare-exchange instead of TOP_K dependent max-reductions);
            # keys are distinct (the index bits), so this is the loop's selection in its order
            top = tl.topk(packed, SEL_K)  # [ROWS, SEL_K]
            if K_PAD != SEL_K:  # K_PAD = 2 SEL_K (the shared column): the SEL_K columns twice
                top = tl.reshape(tl.permute(tl.join(top, top), (0, 2, 1)), [key.shape[0], K_PAD])
            chosen = kk < TOP_K
            top_idx, top_z = _unpack_keys(top, BLOCK_E, PACK_DTYPE)
            ids = tl.where(chosen, top_idx, 0)
            z_sel = tl.where(chosen, top_z, 0.0)
        else:
            ids = tl.zeros([key.shape[0], K_PAD], dtype=tl.int32)
            z_sel = tl.zeros([key.shape[0], K_PAD], dtype=tl.float32)
            for i in range(TOP_K):
                best_idx, best_z = _unpack_keys(tl.max(packed, axis=1), BLOCK_E, PACK_DTYPE)
                idx = best_idx[:, None]
                if PACK_DTYPE != 0:
                    z_sel = tl.where(kk == i, best_z[:, None], z_sel)
                ids = tl.where(kk == i, idx, ids)
                packed = tl.where(offs == idx, -9223372036854775807, packed)
        return ids, z_sel

    @triton.jit
    def _route_weights(z_sel, ids, softcap, scale, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                       NUM_SHARED: tl.constexpr, K_PAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                       SQRT_SOFTPLUS: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr):
        # z_sel [ROWS, K_PAD]: the chosen experts' fp32 logits (columns >= TOP_K ignored) ->
        # (weights [ROWS, K_PAD] rounded to the output dtype, kept in fp32; ids with the shared
        # column): the unbiased scores, normalised, scaled; the shared column id E, weight 1
        kk = tl.arange(0, K_PAD)[None, :]
        routed = kk < TOP_K
        w = tl.where(routed, _scores(z_sel, softcap, HAS_SOFTCAP, SQRT_SOFTPLUS), 0.0)
        if NORM:
            # (the order of this sum follows the tile's layout: the two kernels may differ in
            # the last fp32 bit here)
            w = tl.math.div_rn(w, tl.zeros_like(w) + tl.sum(w, axis=1)[:, None])
        w = w * scale
        if NUM_SHARED > 0:  # one shared column: id E, weight 1 (not scaled)
            shared = kk == TOP_K
            w = tl.where(shared, 1.0, w)
            ids = tl.where(shared, NUM_EXPERTS, ids)
        return _round_to(w, OUT_DTYPE), ids

    @triton.jit
    def _store_routes(weights_ptr, ids_ptr, rows, row_ok, w, ids, TOP_K: tl.constexpr,
                      NUM_SHARED: tl.constexpr, K_PAD: tl.constexpr):
        # rows / row_ok [ROWS, 1]; outputs contiguous [T, TOP_K + NUM_SHARED]
        kk = tl.arange(0, K_PAD)[None, :]
        out = rows * (TOP_K + NUM_SHARED) + kk
        keep = row_ok & (kk < TOP_K + NUM_SHARED)
        tl.store(weights_ptr + out, w, mask=keep)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=keep)

    @triton.jit
    def _moe_route_kernel(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr,
        stride_lt, stride_le, stride_b,
        softcap, scale,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
        NUM_SHARED: tl.constexpr, K_PAD: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr, NORM: tl.constexpr,
        OUT_DTYPE: tl.constexpr, PACK_DTYPE: tl.constexpr, PDL: tl.constexpr,
        BITONIC: tl.constexpr, SEL_K: tl.constexpr,
    ):
        # program t routes token t (one-row tiles [1, BLOCK_E])
        row = tl.program_id(0).to(tl.int64)
        logits_row = logits_ptr + row * stride_lt
        offs = tl.arange(0, BLOCK_E)[None, :]
        valid = offs < NUM_EXPERTS
        # the bias is a parameter (no kernel writes it): loaded before the PDL wait
        bias = tl.load(bias_ptr + offs * stride_b, mask=valid, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()  # the logits are the router GEMM's output
        z = tl.load(logits_row + offs * stride_le, mask=valid, other=0.0).to(tl.float32)
        s = _scores(z, softcap, HAS_SOFTCAP, SQRT_SOFTPLUS)
        ids, z_sel = _select_top_k(s + bias, z, valid, offs, BLOCK_E, TOP_K, K_PAD, PACK_DTYPE, BITONIC,
                                   SEL_K)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if PACK_DTYPE == 0:  # the chosen experts' fp32 logits re-read (cache-hot)
            routed = tl.arange(0, K_PAD)[None, :] < TOP_K
            z_sel = tl.load(logits_row + ids * stride_le, mask=routed, other=0.0).to(tl.float32)
        # their scores recomputed, same math
        w, ids = _route_weights(z_sel, ids, softcap, scale, NUM_EXPERTS, TOP_K, NUM_SHARED, K_PAD,
                                HAS_SOFTCAP, SQRT_SOFTPLUS, NORM, OUT_DTYPE)
        _store_routes(weights_ptr, ids_ptr, tl.zeros([1, 1], dtype=tl.int64) + row,
                      tl.full([1, 1], True, tl.int1), w, ids, TOP_K, NUM_SHARED, K_PAD)

    # ---- router GEMM + routing in one launch (fused_router_route)

    @triton.jit
    def _sum_partials(ptrs, mask, SPLIT_K: tl.constexpr, SLAB: tl.constexpr, OUT_DTYPE: tl.constexpr):
        # the logits at ptrs (into split 0's slab): the SPLIT_K fp32 partials summed in split order
        # (read from L2: other programs wrote them), rounded to the output dtype as F.linear's output
        total = tl.zeros(ptrs.shape, dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(ptrs + s * SLAB, mask=mask, other=0.0, cache_modifier=".cg")
        return _round_to(total, OUT_DTYPE)

    @triton.jit
    def _router_route_kernel(
        x_ptr, w_ptr, bias_ptr, weights_ptr, ids_ptr, part_ptr, count_ptr,
        T, stride_xt, stride_b,
        softcap, scale, pf_ptr, pf_nbytes, pf_stride, pf_size,
        HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
        NUM_SHARED: tl.constexpr, K_PAD: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr, NORM: tl.constexpr,
        OUT_DTYPE: tl.constexpr, PACK_DTYPE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, SPLIT_K: tl.constexpr,
        M_PAD: tl.constexpr, ROUTE_ROWS: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr,
        X_GROUP: tl.constexpr, PART_ROWS: tl.constexpr, PDL: tl.constexpr,
        BITONIC: tl.constexpr, SEL_K: tl.constexpr, PF_BLOCK: tl.constexpr, PF_LANES: tl.constexpr,
        PF_AT: tl.constexpr,
    ):
        # program (j, s): experts [j BLOCK_N, (j + 1) BLOCK_N), K chunk [s Kc, (s + 1) Kc) with
        # Kc = K_STEPS * BLOCK_K: the weight as one [BLOCK_N, K_STEPS, 1, BLOCK_K] tile, x rows as
        # [BLOCK_N, K_STEPS, X_GROUP, BLOCK_K] tiles (module docstring)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n4 = offs_n[:, None, None, None]
        k_in = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        k4 = (pid_k * (K_STEPS * BLOCK_K) + tl.arange(0, K_STEPS)[None, :, None, None] * BLOCK_K
              + k_in[None, None, None, :])
        w_ptrs = w_ptr + n4.to(tl.int64) * HIDDEN + k4
        # the weight (a parameter) before the PDL wait; read once: evict_first
        if MASK_N or MASK_K:
            wt = tl.load(w_ptrs, mask=(n4 < NUM_EXPERTS) & (k4 < HIDDEN), other=0.0,
                         eviction_policy="evict_first")
        else:
            wt = tl.load(w_ptrs, eviction_policy="evict_first")
        # a weight a later kernel reads into L2 while this latency-bound launch leaves the HBM
        # idle (never written, so also before the wait: kernels/pdl.py rule 3); a hint, no value
        if PF_LANES > 0 and PF_AT == 0:
            _prefetch_l2_lanes(pf_ptr, pf_nbytes, pf_stride, pf_size, pid_n * SPLIT_K + pid_k, PF_BLOCK,
                               PF_LANES)
        wt = wt.to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        if PF_LANES > 0 and PF_AT == 1:
            _prefetch_l2_lanes(pf_ptr, pf_nbytes, pf_stride, pf_size, pid_n * SPLIT_K + pid_k, PF_BLOCK,
                               PF_LANES)
        # x in the weight tile's layout (stride 0 along n: no shuffle; the redundant lanes hit
        # L1), X_GROUP rows per load so that their L2 latencies overlap
        x_k = k4 + n4 * 0
        g4 = tl.arange(0, X_GROUP)[None, None, :, None]
        g2 = tl.arange(0, X_GROUP)[None, :]
        n2 = offs_n[:, None]
        slab = part_ptr + pid_k * (PART_ROWS * NUM_EXPERTS) + n2
        for r0 in tl.static_range(0, M_PAD, X_GROUP):
            x_ptrs = x_ptr + (r0 + g4) * stride_xt + x_k
            if MASK_K:
                xg = tl.load(x_ptrs, mask=(r0 + g4 < T) & (x_k < HIDDEN), other=0.0)
            else:
                xg = tl.load(x_ptrs, mask=r0 + g4 < T, other=0.0)
            # the K_STEPS in-thread, then BLOCK_K across the warp's lanes: fp32 partial logits
            pm = tl.sum(tl.sum(wt * xg.to(tl.float32), axis=1), axis=2)  # [BLOCK_N, X_GROUP]
            # -> part[pid_k, row, n] (plain stores; the last program reads them through L2)
            tl.store(slab + (r0 + g2) * NUM_EXPERTS, pm, mask=(n2 < NUM_EXPERTS) & (r0 + g2 < T))
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()  # the weights and x are read

        # semaphore: the last program to arrive reduces and routes (the skinny GEMM's split-K
        # pattern: every thread's partials stored, CTA barrier, one acq_rel atomic)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if PF_LANES > 0 and PF_AT == 2:
            if arrived != tl.num_programs(0) * SPLIT_K - 1:
                _prefetch_l2_lanes(pf_ptr, pf_nbytes, pf_stride, pf_size, pid_n * SPLIT_K + pid_k,
                                   PF_BLOCK, PF_LANES)
        if arrived == tl.num_programs(0) * SPLIT_K - 1:
            offs_e = tl.arange(0, BLOCK_E)[None, :]
            valid = offs_e < NUM_EXPERTS
            bias = tl.load(bias_ptr + offs_e * stride_b, mask=valid, other=0.0).to(tl.float32)
            for r0 in tl.static_range(0, M_PAD, ROUTE_ROWS):
                rows = r0 + tl.arange(0, ROUTE_ROWS)[:, None]
                row_ok = rows < T
                z = _sum_partials(part_ptr + rows * NUM_EXPERTS + offs_e, row_ok & valid, SPLIT_K,
                                  PART_ROWS * NUM_EXPERTS, OUT_DTYPE)
                s = _scores(z, softcap, HAS_SOFTCAP, SQRT_SOFTPLUS)
                ids, z_sel = _select_top_k(s + bias, z, valid, offs_e, BLOCK_E, TOP_K, K_PAD,
                                           PACK_DTYPE, BITONIC, SEL_K)
                if PACK_DTYPE == 0:
                    # fp32 logits do not fit the packed key: the same sums of the same partials
                    # again (bitwise the same values), one more dependent L2 round trip. (A
                    # variant gathering them from registers, tl.gather, together with a
                    # fixed-order norm sum, timed ~2 us slower at T = 1 on the H200.)
                    routed = tl.arange(0, K_PAD)[None, :] < TOP_K
                    z_sel = _sum_partials(part_ptr + rows * NUM_EXPERTS + ids, row_ok & routed,
                                          SPLIT_K, PART_ROWS * NUM_EXPERTS, OUT_DTYPE)
                w, ids = _route_weights(z_sel, ids, softcap, scale, NUM_EXPERTS, TOP_K, NUM_SHARED,
                                        K_PAD, HAS_SOFTCAP, SQRT_SOFTPLUS, NORM, OUT_DTYPE)
                _store_routes(weights_ptr, ids_ptr, rows, row_ok, w, ids, TOP_K, NUM_SHARED, K_PAD)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # re-armed for the next call


def _check_routing(e: int, device: torch.device, bias: torch.Tensor, top_k: int, softcap: float,
                   score_func: str, num_shared: int) -> None:
    # the routing arguments of both entry points, for E experts on device
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r} is not supported; use one of {SCORE_FUNCS}")
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"E={e} experts; the routing kernels support 1..{MAX_EXPERTS}")
    if tuple(bias.shape) != (e,):
        raise ValueError(f"bias must be [E]=[{e}], got shape {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise ValueError(f"bias must be a float tensor, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device}, the router inputs on {device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, E={e}], got {top_k!r}")
    if not softcap >= 0:  # also rejects NaN
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap!r}")
    if num_shared not in (0, 1):
        raise ValueError(f"num_shared must be 0 or 1, got {num_shared!r}")


def _check(logits: torch.Tensor, bias: torch.Tensor, top_k: int, softcap: float,
           score_func: str, num_shared: int) -> None:
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r} is not supported; use one of {SCORE_FUNCS}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if logits.dtype not in _OUT_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    _check_routing(logits.shape[1], logits.device, bias, top_k, softcap, score_func, num_shared)


def fused_moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    softcap: float,
    score_func: str,
    norm_topk_prob: bool,
    scale: float = 1.0,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits -> (weights, expert ids) in one Triton launch (math in the module docstring).

    Args:
        logits: ``[T, E]`` router logits, fp32 / bf16 / fp16, any strides; ``1 <= E <= 1024``.
        bias: ``[E]`` selection bias (``e_score_correction_bias``), any float dtype, used in fp32.
        top_k: experts per token, ``1 <= top_k <= E``.
        softcap: logit soft-capping ``tanh(z / softcap) * softcap``; 0 turns it off.
        score_func: ``"sigmoid"`` or ``"sqrtsoftplus"``.
        norm_topk_prob: divide the chosen weights by their sum.
        scale: multiplies the routed weights (the routed scaling factor), after the division.
        num_shared: 0, or 1 to append a shared-expert column (id ``E``, weight 1.0).

    Returns:
        ``(weights [T, top_k + num_shared] in logits.dtype, ids [T, top_k + num_shared] int64)``,
        both contiguous; ids in descending order of ``s + bias`` (ties: lower index first).
        Runs where :func:`is_available` says (CUDA sm80+, or a CPU under the interpreter).
    """
    _check(logits, bias, top_k, softcap, score_func, num_shared)
    t, e = logits.shape
    k_out = top_k + num_shared
    weights = torch.empty((t, k_out), device=logits.device, dtype=logits.dtype)
    ids = torch.empty((t, k_out), device=logits.device, dtype=torch.int64)
    if t == 0:
        return weights, ids
    assert HAS_TRITON, "fused_moe_route needs triton (check is_available first)"
    block_e = triton.next_power_of_2(e)
    use_pdl = pdl.active(logits.device, interpret_mode())
    _moe_route_kernel[(t,)](
        logits, bias, weights, ids,
        logits.stride(0), logits.stride(1), bias.stride(0),
        float(softcap), float(scale),
        NUM_EXPERTS=e, BLOCK_E=block_e, TOP_K=top_k, NUM_SHARED=num_shared,
        K_PAD=triton.next_power_of_2(k_out),
        HAS_SOFTCAP=softcap > 0, SQRT_SOFTPLUS=score_func == "sqrtsoftplus",
        NORM=bool(norm_topk_prob), OUT_DTYPE=DTYPE_CODE[logits.dtype],
        PACK_DTYPE=_pack_dtype(logits.dtype), PDL=use_pdl,
        BITONIC=TOPK_BITONIC, SEL_K=_next_pow2(top_k),
        num_warps=max(1, min(4, block_e // 256)),  # 8 keys a thread; one warp up to E = 256
        **pdl.launch_options(use_pdl),
    )
    return weights, ids


# ---- router GEMM + routing: host side ---------------------------------------------------------------


@dataclass(frozen=True)
class RouterConfig:
    """Tiles of :func:`fused_router_route` (see the module docstring; the defaults per token
    count: :func:`default_router_config`).

    Attributes:
        block_n: experts per program, a power of two in [1, 64].
        num_warps: warps per program (1, 2, 4, 8 or 16).
        programs: the grid size aimed at: K is split until about this many programs run.
        max_k_steps: at most this many ``BLOCK_K`` steps per program (a power of two; each thread
            holds ``max_k_steps * 16`` bytes of weight per expert row it covers).
        x_elems: x elements a thread loads at once (a power of two): the rows of x are loaded in
            groups of ``x_elems / (K_STEPS * 16 bytes)`` rows (their L2 latencies overlap).
    """

    block_n: int = 8
    num_warps: int = 8
    programs: int = 128
    max_k_steps: int = 4
    x_elems: int = 128


# Measured on the H200 (benchmarks/bench_router_route.py: E = 256, H = 2048, bf16, us per layer in
# a PDL-chained CUDA graph, weights from HBM; the two-launch path skinny GEMM + fused_moe_route in
# brackets): T = 1: 4.33 (5.14), T = 2: 4.77 (5.78) with 4 warps (fewer warps meet at the top-k
# steps' barriers); T = 3: 5.35 (5.82), T = 4: 5.62 (5.82) with 8 warps (16 rows of x multiply
# faster). Past 4 tokens the last program's routing of every token alone outweighs the launch
# saved: T = 8: 7.1 (5.9), T = 16: 10.9 (6.0) (models.layers.MoE.fused_router_max_tokens = 4).
_ROUTER_CONFIG_FEW = RouterConfig(block_n=8, num_warps=4, programs=128, max_k_steps=4, x_elems=128)
_ROUTER_CONFIG_MANY = RouterConfig(block_n=8, num_warps=8, programs=128, max_k_steps=4, x_elems=256)


def default_router_config(t: int) -> RouterConfig:
    """The tiles :func:`fused_router_route` uses for ``t`` tokens without an explicit config."""
    return _ROUTER_CONFIG_FEW if t <= 2 else _ROUTER_CONFIG_MANY
_ROUTE_TILE = 4096  # elements of one [ROUTE_ROWS, BLOCK_E] routing tile (the last program)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _is_pow2(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _check_router_config(cfg: RouterConfig) -> None:
    if not isinstance(cfg, RouterConfig):
        raise ValueError(f"config must be a RouterConfig or None, got {type(cfg).__name__}")
    if not (_is_pow2(cfg.block_n) and cfg.block_n <= 64):
        raise ValueError(f"config.block_n must be a power of two in [1, 64], got {cfg.block_n!r}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config.num_warps must be 1, 2, 4, 8 or 16, got {cfg.num_warps!r}")
    if isinstance(cfg.programs, bool) or not isinstance(cfg.programs, int) or cfg.programs < 1:
        raise ValueError(f"config.programs must be an int >= 1, got {cfg.programs!r}")
    if not (_is_pow2(cfg.max_k_steps) and cfg.max_k_steps <= 16):
        raise ValueError(f"config.max_k_steps must be a power of two in [1, 16], got {cfg.max_k_steps!r}")
    if not (_is_pow2(cfg.x_elems) and cfg.x_elems <= 1024):
        raise ValueError(f"config.x_elems must be a power of two in [1, 1024], got {cfg.x_elems!r}")


@functools.lru_cache(maxsize=1024)
def _router_plan(t: int, e: int, h: int, dtype: torch.dtype, cfg: RouterConfig,
                 use_pdl: bool) -> tuple[tuple[int, int], dict]:
    """(grid, tile constexprs and launch keywords) of one call, cached (the eager host path is a
    dict lookup and one launch). The routing constexprs are added by the caller."""
    _check_router_config(cfg)
    # one warp's lanes cover BLOCK_K with 16-byte loads (256 bf16 / 128 fp32 elements): with at
    # least as many expert rows as warps, every K reduction stays inside a warp (shuffles only)
    vec = 16 // dtype.itemsize
    block_k = min(32 * vec, _next_pow2(h))
    tiles = _cdiv(e, cfg.block_n)
    split = max(1, min(_cdiv(cfg.programs, tiles), _cdiv(h, block_k)))
    k_steps = min(cfg.max_k_steps, _next_pow2(_cdiv(_cdiv(h, split), block_k)))
    split = _cdiv(h, k_steps * block_k)  # every chunk non-empty
    block_e = _next_pow2(e)
    m_pad = _next_pow2(t)
    meta = dict(
        HIDDEN=h, BLOCK_N=cfg.block_n, BLOCK_K=block_k, K_STEPS=k_steps, SPLIT_K=split, M_PAD=m_pad,
        ROUTE_ROWS=min(m_pad, max(1, _ROUTE_TILE // block_e)),
        X_GROUP=min(m_pad, max(1, cfg.x_elems // (k_steps * min(vec, block_k)))),
        MASK_N=e % cfg.block_n != 0, MASK_K=h != split * k_steps * block_k,
        PART_ROWS=MAX_ROUTER_TOKENS, PDL=use_pdl,
        num_warps=cfg.num_warps, num_stages=1, **pdl.launch_options(use_pdl),
    )
    return (tiles, split), meta


_ROUTER_WORKSPACES: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = register_state({})


def _router_workspace(device: torch.device, e: int, split_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial logits ``[split_k, 16, e]`` fp32, arrival counter ``[1]`` int32 zero) for one
    ``(device, e, split_k)``: allocated and zeroed once, kept (captured graphs point at them)."""
    key = (device, e, split_k)
    ws = _ROUTER_WORKSPACES.get(key)
    if ws is None:
        part = torch.empty((split_k, MAX_ROUTER_TOKENS, e), dtype=torch.float32, device=device)
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        ws = _ROUTER_WORKSPACES[key] = (part, counter)
    return ws


def _check_router_inputs(x: torch.Tensor, router_weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T, H], got shape {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(router_weight, torch.Tensor) or router_weight.dim() != 2:
        raise ValueError(f"router_weight must be a 2-D tensor [E, H], got shape "
                         f"{tuple(getattr(router_weight, 'shape', ()))}")
    t, h = x.shape
    if t > MAX_ROUTER_TOKENS:
        raise ValueError(f"x has T={t} tokens; fused_router_route supports T <= {MAX_ROUTER_TOKENS} "
                         "(use linear + fused_moe_route)")
    if h < 1 or router_weight.shape[1] != h:
        raise ValueError(f"x [T, H={h}] and router_weight [E, H={router_weight.shape[1]}] disagree "
                         "on H (or H is 0)")
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if router_weight.dtype != x.dtype:
        raise ValueError(f"router_weight dtype {router_weight.dtype} differs from x dtype {x.dtype}")
    if router_weight.device != x.device:
        raise ValueError(f"router_weight is on {router_weight.device}, x on {x.device}")
    if x.stride(1) != 1 and h > 1:
        raise ValueError(f"x must have unit column stride, got strides {tuple(x.stride())}")
    if not router_weight.is_contiguous():
        raise ValueError("router_weight must be contiguous [E, H]; pass router_weight.contiguous()")


def can_fuse_router(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether :func:`fused_router_route` accepts ``(x, router_weight)`` and can run where they
    live (shapes, dtypes, strides as it checks them; ``1 <= T <= 16``; :func:`is_available`)."""
    return (
        x.dim() == 2 and router_weight.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROUTER_TOKENS and x.shape[1] >= 1
        and router_weight.shape[1] == x.shape[1] and 1 <= router_weight.shape[0] <= MAX_EXPERTS
        and x.dtype in _OUT_DTYPES and router_weight.dtype == x.dtype
        and router_weight.device == x.device
        and (x.stride(1) == 1 or x.shape[1] == 1) and router_weight.is_contiguous()
        and is_available(x.device)
    )


def fused_router_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    softcap: float,
    score_func: str,
    norm_topk_prob: bool,
    scale: float = 1.0,
    num_shared: int = 0,
    *,
    config: RouterConfig | None = None,
    prefetch: torch.Tensor | l2_prefetch.Spread | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router GEMM and routing in one Triton launch: ``fused_moe_route(F.linear(x, router_weight),
    bias, ...)`` (module docstring, "Router GEMM fused").

    Args:
        x: ``[T, H]`` hidden states, fp32 / bf16 / fp16, ``1 <= T <= 16`` (``T = 0`` returns empty
            outputs), any row stride, unit column stride.
        router_weight: ``[E, H]`` contiguous, x's dtype and device, ``1 <= E <= 1024``.
        bias, top_k, softcap, score_func, norm_topk_prob, scale, num_shared: as in
            :func:`fused_moe_route`.
        config: tiles (:class:`RouterConfig`); ``None``: :func:`default_router_config` ``(T)``.
        prefetch: bytes of a weight a later kernel reads, brought into L2 by the programs
            where :data:`PREFETCH_AT` says (by default once each has arrived at the semaphore):
            a contiguous region (``l2_prefetch.region``; each program a share from
            :data:`PREFETCH_LANES` lanes) or an ``l2_prefetch.Spread`` (its pieces over the
            programs' lanes; ignored if it has more pieces than lanes); ``None``: nothing.
            CUDA sm90+ only (elsewhere ignored). No value changes.

    Returns:
        ``(weights [T, top_k + num_shared] in x.dtype, ids [T, top_k + num_shared] int64)``,
        contiguous. The logits are ``F.linear``'s up to the order of the fp32 additions (one
        rounding to x.dtype); where the rounded logits agree, the ids equal the two-kernel
        path's and the weights too, up to 1 ulp from the order of norm_topk_prob's sum. Bitwise
        reproducible (fixed summation orders). Runs where :func:`is_available` says; check
        :func:`can_fuse_router` first to fall back to the two-kernel path.
    """
    _check_router_inputs(x, router_weight)
    t, h = x.shape
    e = router_weight.shape[0]
    _check_routing(e, x.device, bias, top_k, softcap, score_func, num_shared)
    k_out = top_k + num_shared
    weights = torch.empty((t, k_out), device=x.device, dtype=x.dtype)
    ids = torch.empty((t, k_out), device=x.device, dtype=torch.int64)
    if t == 0:
        return weights, ids
    assert HAS_TRITON, "fused_router_route needs triton (check is_available first)"
    use_pdl = pdl.active(x.device, interpret_mode())
    grid, meta = _router_plan(t, e, h, x.dtype, config or default_router_config(t), use_pdl)
    part, counter = _router_workspace(x.device, e, meta["SPLIT_K"])
    spread, lanes = l2_prefetch.issue_plan(prefetch, grid[0] * grid[1], 32 * meta["num_warps"], PREFETCH_LANES)
    _router_route_kernel[grid](
        x, router_weight, bias, weights, ids, part, counter,
        t, x.stride(0), bias.stride(0),
        float(softcap), float(scale),
        *((spread.base, spread.nbytes, spread.stride, spread.size) if lanes else (x, 0, 16, 0)),
        NUM_EXPERTS=e, BLOCK_E=_next_pow2(e), TOP_K=top_k, NUM_SHARED=num_shared,
        K_PAD=_next_pow2(k_out), HAS_SOFTCAP=softcap > 0, SQRT_SOFTPLUS=score_func == "sqrtsoftplus",
        NORM=bool(norm_topk_prob), OUT_DTYPE=DTYPE_CODE[x.dtype],
        PACK_DTYPE=_pack_dtype(x.dtype) if meta["ROUTE_ROWS"] == 1 else 0,
        BITONIC=TOPK_BITONIC, SEL_K=_next_pow2(top_k),
        PF_BLOCK=32 * meta["num_warps"], PF_LANES=lanes, PF_AT=PREFETCH_AT, **meta,
    )
    return weights, ids
