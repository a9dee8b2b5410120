"""Skinny GEMM ``y = x @ W^T`` for decode / verify batches (1..16 rows): one Triton launch that
streams the weight once.

For ``x [M, K]``, ``W [N, K]`` (the ``nn.Linear`` layout) and ``M <= 16``::

    y[m, n] = sum_k x[m, k] * W[n, k]          fp32 accumulation, y rounded once to x.dtype

which is ``F.linear(x, W)`` up to the order of the fp32 additions (bf16 / fp16 products are exact
in fp32, so only the summation order differs; the result is within one output ulp of the exact
sum, plus the fp32 accumulation error).

Why: at batch 1 these GEMMs are pure weight streaming (``2 N K`` bytes, the activations are a
few KiB), but on an H200 cuBLAS runs them at ~2.6-3.2 TB/s of the ~4.3 TB/s copy bandwidth, and
for the ``o_proj`` shapes (``N = 2048``, long ``K``) it splits K and adds a separate
``splitKreduce`` kernel (~1.7 us). Here the tile shapes are picked per shape (:func:`default_config`,
filled from ``benchmarks/bench_skinny_gemm.py``) and the split-K reduction happens inside the
same launch.

Grid ``(ceil(N / BLOCK_N), SPLIT_K)``: program ``(j, s)`` owns output columns
``[j BLOCK_N, (j + 1) BLOCK_N)`` and the K chunk ``[s Ks, (s + 1) Ks)`` (``Ks`` = ``K / SPLIT_K``
rounded up to a multiple of ``BLOCK_K``). It loops over its chunk ``BLOCK_K`` at a time, loading
the ``[BLOCK_N, BLOCK_K]`` weight tile (``evict_first``: each weight byte is read once)
and the rows of ``x`` over the same K range (L2-resident, re-read by every column tile), two ways:

* ``USE_DOT = False`` (the default for ``M <= 4``; only for ``M <= 4``): a GEMV. Each row of x
  has its own fp32 ``[BLOCK_N, BLOCK_K]`` accumulator in the weight tile's register layout, so a
  step is one FMA per weight element and row with no cross-thread traffic; the K reduction
  (``tl.sum``) happens once, after the loop. The x slice is loaded either already in the weight
  tile's shape (``X_BCAST``, stride 0 along N: same layout, no shared memory or barrier in the
  loop, the redundant lanes hit L1) or as a ``[BLOCK_K]`` vector broadcast after the load (the
  compiler then spreads it through shared memory, two barriers a step). With ``num_stages >= 2``
  the next step's loads are issued before this step's FMAs (Triton's pipeliner only stages loads
  that feed ``tl.dot``, so the GEMV double-buffers in registers). Checked on the sm_90 PTX
  (offline compile): no shared memory or barrier in the loop, 16-byte loads; a 3-D
  ``[M, BLOCK_N, BLOCK_K]`` formulation instead round-trips the weight tile itself through
  shared memory every step. At 4 rows the GEMV's full accumulators made it twice as slow in the
  verify graph as the dot path (fifty-fifth pass); its register fix, ``[BLOCK_N, BLOCK_K / 8, 8]``
  tiles adding each 16-byte vector's 8 products to 1/8 of the accumulators, lost too (sixty-sixth
  pass: the 4-token verify graph 3.70-4.17 ms against 3.68 with the dot path, the drafter block
  0.44-0.58 against 0.33 ms) and was removed (commit 5d91d44 is the last tree with it).
* ``USE_DOT = True`` (default for ``M > 4``): ``acc [BLOCK_N, M_PAD] += W_tile @ x_tile^T`` on
  the tensor cores, with ``M_PAD = 16`` (tl.dot's minimum) and the weight as the wide operand
  ("swap AB": the padding falls on the 16-wide side). Triton stages the weight tiles through
  shared memory with ``cp.async`` (``num_stages`` deep); on sm_90 this is ``wgmma m64n16k16``
  for ``BLOCK_N >= 64`` and 4 warps, ``mma.sync`` otherwise.

The trip count ``Ks / BLOCK_K`` is a compile-time constant (one compile per weight shape and
config; the interpreter cannot loop over a runtime bound).

Split-K (``SPLIT_K > 1``) without a second launch, deterministic: every program stores its fp32
partial ``[M, BLOCK_N]`` into a workspace slab ``part[s]`` (plain stores), then (CTA barrier)
one thread increments the column tile's arrival counter with an ``acq_rel`` atomic (the CUTLASS
semaphore pattern: barrier, then a gpu-scope release by one thread). The program that sees
``SPLIT_K - 1`` arrived last: it reads the ``SPLIT_K`` partials from L2 (``.cg``) and sums them
IN SPLIT ORDER ``s = 0, 1, ...`` (so the result does not depend on the arrival order; bitwise
reproducible), rounds to the output dtype, stores ``y`` and resets the counter to 0. The
partials need no reset (every call overwrites the slabs it reads), so a call leaves the
workspace ready for the next one: no memset launch, CUDA-graph replayable.

The workspace (``part [SPLIT_K, 16, N]`` fp32 and ``counters [ceil(N / 8)]`` int32, zeroed once)
is cached per ``(device, N, SPLIT_K)`` in a module dict and never freed (a captured graph keeps
pointing at it). Make the first call of a shape outside a CUDA-graph capture (the compile /
warm-up call does this); a first call inside a capture still works, the zeroing is then
recorded into the graph and the buffer comes from the graph's pool. Two split-K calls with the
same ``(N, SPLIT_K)`` must not run concurrently on different streams (they share counters).

With ``kernels.pdl.USE_PDL`` (on by default) the kernel is launched with programmatic
dependent launch: a program loads its first weight tile, then waits for the previous kernel
before it loads x, and signals its dependents once its weights are read (kernels/pdl.py).

``glu=True`` (a dense MLP's ``gate_up [2I, K]``, gate rows first): the SwiGLU in the epilogue,
``y [M, I] = silu(x Wg^T) * (x Wu^T)``. Column tile ``j`` holds virtual rows ``v = 2c + h``
(weight row ``h I + c``: the gate and up rows of output columns ``c``), so the activation needs
nothing from another program; with split-K the last program applies it after the reduction.
Gate and up are rounded where the plain GEMM stores them, then activated as
``kernels/silu_mul.py`` does: bitwise ``silu_mul(skinny_gemm(x, W))`` under the same config,
with one launch fewer and no ``[M, 2I]`` round trip.

``scale=`` with a ``float8_e4m3fn`` weight (weight-only fp8, a drafter's option:
``models/fp8.py``) or an ``int8`` one (the lm_head copy of ``kernels/greedy_lm_head.py``):
``y[m, n] = scale[n] * sum_k x[m, k] Wq[n, k]``, the weight streamed at one byte an element (half
of bf16's bytes) and widened to x's dtype in registers (exact), fp32 accumulation as above, the
row scale applied before the split-K partials and the rounding.

The grid and every launch argument depend only on the shapes and the config (no host sync, no
data-dependent sizes): capturable. fp32 inputs accumulate exact products (``tl.dot`` in "ieee"
precision, not tf32). Under Triton's CPU interpreter the dot path also runs in fp32 (its bf16
``tl.dot`` is wrong in triton 3.6) and the output is rounded on the bits (its fp32 -> bf16 cast
truncates; ``jit._round_to``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import pdl
from .availability import interpret_mode, triton_can_run
from .jit import DTYPE_CODE, _round_to, jit_functions
from .pdl import launch_options
from .precompile import register_state

if TYPE_CHECKING:
    import triton.language as tl

__all__ = [
    "FP8_DTYPE",
    "MAX_M",
    "MAX_ROW_BLOCKS",
    "SkinnyConfig",
    "can_use",
    "default_config",
    "is_available",
    "skinny_gemm",
    "skinny_gemm_rows",
    "skinny_gemm_reference",
]

MAX_M = 16  # rows of x; also the row capacity of the split-K workspace
MAX_ROW_BLOCKS = 64  # 16-row blocks of one skinny_gemm_rows launch (its workspace's capacity)
_MAX_GEMV_M = 4  # rows of the GEMV path (one accumulator each)
_MIN_BLOCK_N = 8  # counters per N: ceil(N / _MIN_BLOCK_N) covers every allowed block_n
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn  # a weight of this dtype comes with per-row fp32 scales
QUANT_DTYPES = (FP8_DTYPE, torch.int8)  # one-byte weights, each with per-row fp32 scales
_NUM_SMS_H200 = 132


# ---- configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch configuration of :func:`skinny_gemm`.

    Attributes:
        block_n: output columns (weight rows) per program, a power of two in [8, 1024]
            (>= 16 with the dot path).
        block_k: K elements per loop step, a power of two in [16, 4096].
        split_k: programs along K per column tile (1 = no split), in [1, 64]; reduced
            in-kernel (module docstring). Trimmed to the number of non-empty chunks.
        num_warps: warps per program (1, 2, 4, 8 or 16).
        num_stages: dot path: Triton's software-pipelining depth (shared-memory stages of the
            weight tile; with fp32 operands capped to fit shared memory, ``_dot_stages``); GEMV path: 1 = plain loop, >= 2 = the loads of the next K step are
            issued before this step's FMAs (a register double buffer). >= 1.
        use_dot: ``tl.dot`` on a 16-row padded x (True), the GEMV (False; ``M <= 4`` only), or
            None: dot for ``M > 4``.
        evict_first: load the weight with ``eviction_policy="evict_first"`` (streamed once).
        x_bcast: GEMV path only: load x in the weight tile's shape (True) or as a vector
            broadcast through shared memory (False); see the module docstring.
    """

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool | None = None
    evict_first: bool = True
    x_bcast: bool = True


# Measured best configs, keyed by (m_bucket, N, K) with m_bucket = next_pow2(M) (1, 2, 4, 8, 16).
# Filled from the dict that benchmarks/bench_skinny_gemm.py prints. A lookup for M tries the
# buckets >= next_pow2(M) in increasing order (a config tuned for more rows is valid for fewer),
# then falls back to :func:`_heuristic_config`.
# Measured on an H200 (2026-11-29, benchmarks/bench_skinny_gemm.py --m 1,4,16 --shapes
# 10240x2048,2048x10240; CUDA-graph replays, weights cycling through > L2); each entry beat
# cuBLAS F.linear at its shape (the comment gives both times).
_MEASURED: dict[tuple[int, int, int], SkinnyConfig] = {
    (1, 256, 2048): SkinnyConfig(block_n=8, block_k=256, split_k=4, num_warps=8, num_stages=1, use_dot=False, evict_first=True, x_bcast=True),  # 3.01 us, cuBLAS 5.63 us
    (1, 2048, 6144): SkinnyConfig(block_n=8, block_k=256, split_k=4, num_warps=4, num_stages=2, use_dot=False, evict_first=True, x_bcast=False),  # 8.94 us, cuBLAS 11.43 us
    (1, 2048, 8192): SkinnyConfig(block_n=16, block_k=256, split_k=4, num_warps=8, num_stages=2, use_dot=False, evict_first=True, x_bcast=True),  # 11.18 us, cuBLAS 13.51 us
    (1, 2048, 10240): SkinnyConfig(block_n=8, block_k=256, split_k=4, num_warps=4, num_stages=2, use_dot=False, evict_first=True, x_bcast=True),  # 13.40 us, cuBLAS 16.31 us
    (1, 8240, 2048): SkinnyConfig(block_n=16, block_k=256, split_k=1, num_warps=8, num_stages=2, use_dot=False, evict_first=True, x_bcast=True),  # 10.25 us, cuBLAS 11.19 us
    (1, 10240, 2048): SkinnyConfig(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=2, use_dot=False, evict_first=True, x_bcast=False),  # 12.06 us, cuBLAS 12.83 us
    (1, 10304, 2048): SkinnyConfig(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=2, use_dot=False, evict_first=True, x_bcast=False),  # 12.09 us, cuBLAS 13.66 us
    (1, 16384, 2048): SkinnyConfig(block_n=8, block_k=128, split_k=1, num_warps=8, num_stages=1, use_dot=False, evict_first=True, x_bcast=True),  # 17.74 us, cuBLAS 18.64 us
    (4, 256, 2048): SkinnyConfig(block_n=16, block_k=256, split_k=8, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 3.66 us, cuBLAS 5.64 us
    (4, 2048, 6144): SkinnyConfig(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 9.54 us, cuBLAS 11.68 us
    (4, 2048, 8192): SkinnyConfig(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 11.55 us, cuBLAS 13.58 us
    (4, 2048, 10240): SkinnyConfig(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 13.66 us, cuBLAS 16.07 us
    (4, 8240, 2048): SkinnyConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 10.35 us, cuBLAS 11.18 us
    (4, 10240, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 12.63 us, cuBLAS 12.88 us
    (4, 10304, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 12.75 us, cuBLAS 13.80 us
    (4, 16384, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, use_dot=True, evict_first=False, x_bcast=True),  # 18.26 us, cuBLAS 18.77 us
    # the lm_head (V 100352 x H 2048: XS-2.1 and its drafter), measured 2026-12-04 with
    # bench_skinny_gemm.py --only --shapes 100352x2048 --m 1,4 (docs/PERFORMANCE.md, sixty-first pass)
    (1, 100352, 2048): SkinnyConfig(block_n=8, block_k=128, split_k=1, num_warps=8, num_stages=1, use_dot=False, evict_first=True, x_bcast=True),  # 91.03 us, cuBLAS 95.59 us
    (4, 100352, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, use_dot=True, evict_first=False, x_bcast=True),  # 93.23 us, cuBLAS 97.18 us
    # S-2.1's lm_head (100352 x 3072) and both lm_heads' two-rank vocabulary shards (50176 rows),
    # measured 2026-12-04 with bench_skinny_gemm.py --only --m 1,4 --shapes
    # 100352x3072,50176x2048,50176x3072 (gpu_check.sh lmhead-sweep; PERFORMANCE.md, sixty-second pass)
    (1, 100352, 3072): SkinnyConfig(block_n=8, block_k=128, split_k=1, num_warps=8, num_stages=1, use_dot=False, evict_first=True, x_bcast=True),  # 137.89 us, cuBLAS 148.37 us
    (4, 100352, 3072): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 140.52 us, cuBLAS 149.84 us
    (1, 50176, 2048): SkinnyConfig(block_n=8, block_k=128, split_k=1, num_warps=8, num_stages=1, use_dot=False, evict_first=True, x_bcast=True),  # 47.93 us, cuBLAS 52.47 us
    (4, 50176, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 49.64 us, cuBLAS 53.31 us
    (1, 50176, 3072): SkinnyConfig(block_n=8, block_k=128, split_k=1, num_warps=8, num_stages=1, use_dot=False, evict_first=True, x_bcast=True),  # 70.71 us, cuBLAS 78.68 us
    (4, 50176, 3072): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 72.28 us, cuBLAS 79.19 us
    (16, 256, 2048): SkinnyConfig(block_n=16, block_k=256, split_k=8, num_warps=4, num_stages=2, use_dot=True, evict_first=True, x_bcast=True),  # 3.75 us, cuBLAS 5.73 us
    (16, 2048, 6144): SkinnyConfig(block_n=32, block_k=256, split_k=4, num_warps=2, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 9.75 us, cuBLAS 11.64 us
    (16, 2048, 8192): SkinnyConfig(block_n=32, block_k=256, split_k=4, num_warps=2, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 11.83 us, cuBLAS 13.80 us
    (16, 2048, 10240): SkinnyConfig(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 14.16 us, cuBLAS 16.37 us
    (16, 8240, 2048): SkinnyConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 10.39 us, cuBLAS 11.19 us
    (16, 10240, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=2, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 12.95 us, cuBLAS 13.05 us
    (16, 10304, 2048): SkinnyConfig(block_n=32, block_k=256, split_k=1, num_warps=2, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 12.97 us, cuBLAS 13.98 us
    (16, 16384, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 18.56 us, cuBLAS 19.08 us
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _dot_auto(m: int) -> bool:
    return m > _MAX_GEMV_M


def _heuristic_config(m: int, n: int, k: int) -> SkinnyConfig:
    """Shape-only guess for an H200 (132 SMs), used until measured values are filled in.

    GEMV path (``M <= 4``): ``M_PAD * BLOCK_N * BLOCK_K = 4096`` keeps the fp32 accumulators at
    32 registers a thread with 4 warps (~70-95 registers in all at sm_90, with the prefetch);
    BLOCK_K = 128 (one 256-byte bf16 row segment per 16 threads, 16-byte vector loads).
    Dot path: 64 x 128 weight tiles (16 KiB), 4 stages.
    Split-K doubles while the grid is under ~2 programs per SM and every chunk keeps >= 4
    K steps.
    """
    m_pad = _next_pow2(m)
    if _dot_auto(m):
        block_n, block_k, stages = 64, 128, 4
    else:
        block_k, stages = 128, 2
        block_n = max(_MIN_BLOCK_N, 4096 // (m_pad * block_k))
    tiles = _cdiv(n, block_n)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * _NUM_SMS_H200 and k // (split * 2) >= 4 * block_k:
        split *= 2
    return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=stages)


# Measured best configs for an e4m3 weight (weight-only fp8, models/fp8.py), keyed as _MEASURED:
# the XS-2.1 drafter's 4-row shapes, tiles widened to fp16 (FP8_DOT_F16), on an H200 (2026-12-05,
# benchmarks/bench_skinny_gemm.py --fp8 --only --m 4 --shapes 100352x2048,16384x2048,2048x8192;
# docs/PERFORMANCE.md, seventieth pass). The comment gives the bf16 kernel's default at the shape
# in the same run: fp8 pays at the lm_head (1.70x) and the gate|up GEMM (1.48x), not at N 2048 x
# K 8192 (1.02x: the drafter keeps o_proj / down in bf16). The 8- and 16-row entries (the
# drafter at batch 2-5, K = 3: gate|up 4 rows a request, the lm_head 3) are the best of the eight
# tiles benchmarks/bench_fp8_rows.py --m 8,16 then timed (one 16-row block), on an H200
# (2026-12-05, seventy-second pass); the comment gives the tile the table gave before (64 x 256,
# 4 warps) in the same run.
_MEASURED_FP8: dict[tuple[int, int, int], SkinnyConfig] = {
    (4, 2048, 8192): SkinnyConfig(block_n=128, block_k=128, split_k=8, num_warps=2, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 10.58 us, bf16 10.84 us
    (4, 16384, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=2, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 11.97 us, bf16 17.70 us
    (4, 100352, 2048): SkinnyConfig(block_n=128, block_k=128, split_k=1, num_warps=2, num_stages=2, use_dot=True, evict_first=True, x_bcast=True),  # 55.70 us, bf16 94.76 us
    (8, 16384, 2048): SkinnyConfig(block_n=64, block_k=256, split_k=1, num_warps=2, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 12.8 us, before 15.0 us
    (8, 100352, 2048): SkinnyConfig(block_n=128, block_k=128, split_k=1, num_warps=2, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 57.2 us, before 76.6 us
    (16, 16384, 2048): SkinnyConfig(block_n=64, block_k=256, split_k=1, num_warps=2, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 11.8 us, before 14.6 us
    (16, 100352, 2048): SkinnyConfig(block_n=128, block_k=128, split_k=1, num_warps=2, num_stages=4, use_dot=True, evict_first=True, x_bcast=True),  # 57.4 us, before 76.0 us
    # a draft vocabulary's lm_head rows (models/draft_vocab.py: 32768 of 100352 token ids), on an
    # H100 80GB (2026-12-07, bench_skinny_gemm.py --fp8 --only --quick --m 4 --shapes
    # 32768x2048; ninety-first pass); the comment gives the config the table gave before (the
    # GEMV heuristic's) in the same run
    (4, 32768, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=2, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 26.76 us, before 63.08 us
}


# Measured best configs for the greedy lm_head's int8 copy (kernels/greedy_lm_head.py), keyed as
# _MEASURED; other shapes and buckets take the e4m3 table's (same bytes). XS-2.1's lm_head at one
# row (a GEMV, where the e4m3 table's 4-row dot tile computes 15 padded rows) and at 2-4 rows
# (S-2.1's, K = 3072, from one sweep: "default" is the bf16 table's tile with block_k doubled), on
# H100 80GB cards (2026-12-06, benchmarks/bench_skinny_gemm.py --int8 --only --m 1,4 --shapes
# 100352x2048, then bench_greedy_lm_head.py with the tile and without it in the same calls:
# 71.3-71.5 against 74.4-74.7 us at one row, 72.2 against 75.0 us at four; docs/PERFORMANCE.md,
# eightieth pass). The comment gives the sweep's time and the e4m3 table's tile in the same run.
_MEASURED_INT8: dict[tuple[int, int, int], SkinnyConfig] = {
    (1, 100352, 2048): SkinnyConfig(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=2, use_dot=False, evict_first=True, x_bcast=False),  # 70.40 us, dot 128x128 72.69 us
    (4, 100352, 2048): SkinnyConfig(block_n=32, block_k=256, split_k=1, num_warps=2, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 71.86 us, dot 128x128 73.77 us
    (1, 100352, 3072): SkinnyConfig(block_n=8, block_k=512, split_k=1, num_warps=4, num_stages=2, use_dot=False, evict_first=True, x_bcast=False),  # 108.44 us, default 114.74 us
    (4, 100352, 3072): SkinnyConfig(block_n=32, block_k=256, split_k=1, num_warps=2, num_stages=3, use_dot=True, evict_first=True, x_bcast=True),  # 107.23 us, default 127.53 us
}


def _measured(m: int, n: int, k: int, fp8: bool = False, int8: bool = False) -> SkinnyConfig | None:
    """The measured config (``fp8``: an e4m3 weight's, ``int8``: an int8 one's) of the smallest
    bucket ``>= next_pow2(m)`` of this ``(n, k)``, or None."""
    table = _MEASURED_INT8 if int8 else _MEASURED_FP8 if fp8 else _MEASURED
    bucket = _next_pow2(max(1, m))
    while bucket <= MAX_M:
        cfg = table.get((bucket, n, k))
        if cfg is not None:
            return cfg
        bucket *= 2
    return None


def _nearest_measured_fp8(m: int, n: int, k: int) -> SkinnyConfig | None:
    """For an e4m3 weight without its own entry: the entry of the same K and row bucket (the
    smallest ``>= next_pow2(m)`` holding one) whose N is nearest ``n`` by ratio. A draft
    vocabulary's lm_head has any number of rows (``--speculative-token-map``), and at 32768 x
    2048 the bf16 heuristic's tile took 2.4x the measured one (ninety-first pass); a tile
    measured at a neighbouring N streams at about its rate. None: no entry of this K."""
    bucket = _next_pow2(max(1, m))
    while bucket <= MAX_M:
        same = [key for key in _MEASURED_FP8 if key[0] == bucket and key[2] == k]
        if same:
            return _MEASURED_FP8[min(same, key=lambda key: abs(math.log(key[1] / n)))]
        bucket *= 2
    return None


def is_tuned(m: int, n: int, k: int) -> bool:
    """Whether a measured config covers ``x [m, k] @ W[n, k]^T``; callers keep cuBLAS for the
    other shapes (the heuristic can be slower than cuBLAS)."""
    return _measured(m, n, k) is not None


# An A/B knob for sweeping a shape's tile inside the CUDA graphs, where the isolated sweep's pick
# need not win (the head GEMM's did not: docs/PERFORMANCE.md, fifty-eighth pass):
# ``"M_BUCKET,N,K"`` (M_BUCKET = next_pow2(M), as in ``_MEASURED``) -> SkinnyConfig fields that
# replace those of the config :func:`default_config` would give, e.g.
# ``{"4,2048,8192": {"split_k": 8}}`` (an e4m3 weight's: ``"fp8,4,2048,8192"``). Empty: the
# table and the heuristic alone. The 4-row
# N 2048 x K 8192 entry (the verify's o_proj, the drafter's o_proj and down) swept this way:
# none of split 8, block_n 32, block_k 128 x 4 stages x split 8, 8 warps or 4 stages beat the
# table's config in the verify or drafter graphs (fifty-ninth pass).
CONFIG_OVERRIDES: dict[str, dict] = {}


def default_config(m: int, n: int, k: int, fp8: bool = False, int8: bool = False) -> SkinnyConfig:
    """Config for ``x [m, k] @ W[n, k]^T``: the measured table (``_MEASURED``, smallest bucket
    ``>= next_pow2(m)`` of this ``(n, k)``), else a shape heuristic; with the fields of a
    :data:`CONFIG_OVERRIDES` entry for this shape replaced. ``1 <= m <= 16``.

    ``fp8`` (an e4m3 weight, one byte an element): its own measured table (``_MEASURED_FP8``),
    else that table's entry of the same K with the nearest N (:func:`_nearest_measured_fp8`),
    else the bf16 config with ``block_k`` doubled, so that a tile and a K step move the same
    bytes (the dot path's at most 256: its tiles are widened in registers); its override key is
    ``"fp8,M_BUCKET,N,K"``. ``int8`` (an int8 weight, implies one byte an element): its own table
    (``_MEASURED_INT8``) first, else the e4m3 weight's config; override key ``"int8,M_BUCKET,N,K"``."""
    fp8 = fp8 or int8
    cfg = _table_config(m, n, k, fp8, int8)
    key = f"{'int8,' if int8 else 'fp8,' if fp8 else ''}{_next_pow2(max(1, m))},{n},{k}"
    fields = CONFIG_OVERRIDES.get(key) if CONFIG_OVERRIDES else None
    if fields is None:
        return cfg
    try:
        return dataclasses.replace(cfg, **fields)
    except TypeError as e:  # a field SkinnyConfig does not have
        raise ValueError(f"skinny_gemm.CONFIG_OVERRIDES entry {fields!r}: SkinnyConfig fields are "
                         f"{[f.name for f in dataclasses.fields(SkinnyConfig)]} ({e})") from None


@functools.lru_cache(maxsize=1024)
def _table_config(m: int, n: int, k: int, fp8: bool = False, int8: bool = False) -> SkinnyConfig:
    if int8 and (cfg := _measured(m, n, k, int8=True)) is not None:
        return cfg
    if fp8 and (cfg := _measured(m, n, k, fp8=True) or _nearest_measured_fp8(m, n, k)) is not None:
        return cfg
    cfg = _measured(m, n, k) or _heuristic_config(m, n, k)
    if fp8:  # the dot path widens each tile in registers: at most 64 x 256 of them (~64 a thread)
        cfg = dataclasses.replace(cfg, block_k=min(2 * cfg.block_k, 256 if _use_dot(cfg, m) else 4096))
    return cfg


# ---- availability -----------------------------------------------------------------------------------


def is_available(device: torch.device | str) -> bool:
    """Triton importable and a CUDA device of compute capability >= 8.0 (bf16 ``tl.dot``), or a
    CPU under ``TRITON_INTERPRET=1``."""
    return triton_can_run(device, min_major=8)


def can_use(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether :func:`skinny_gemm` accepts ``(x, weight, scale)`` and can run where they live: both
    2-D on one device where :func:`is_available`, ``1 <= M <= 16`` (``M = 0`` is also accepted),
    matching K, x of fp32 / bf16 / fp16 and weight of x's dtype, or e4m3 / int8 with ``scale [N]``
    fp32 (contiguous, same device), weight with unit column stride. (Any K and N; ragged tiles
    are masked.)"""
    is_fp8 = weight.dtype in QUANT_DTYPES
    return (
        x.dim() == 2 and weight.dim() == 2
        and x.shape[0] <= MAX_M and x.shape[1] == weight.shape[1]
        and x.dtype in _DTYPES and (weight.dtype == x.dtype or is_fp8)
        and (scale is not None) == is_fp8
        and (scale is None or (scale.shape == (weight.shape[0],) and scale.dtype == torch.float32
                               and scale.is_contiguous() and scale.device == x.device))
        and x.device == weight.device
        and (weight.stride(1) == 1 or weight.shape[1] <= 1)
        and is_available(x.device)
    )


# ---- torch reference ------------------------------------------------------------------------------


def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)``: ``x [M, K] @ weight[N, K]^T -> [M, N]`` in x.dtype; an e4m3
    ``weight`` with ``scale [N]``: its rows times their scales, in fp32, then rounded once."""
    if scale is None:
        return F.linear(x, weight)
    return (F.linear(x.float(), weight.float()) * scale).to(x.dtype)


# ---- Triton kernel ----------------------------------------------------------------------------------
#
# Plain Python here; :func:`_kernels` decorates copies bound to a fresh globals dict (triton stays an
# optional import; helpers resolve through that dict both compiled and interpreted), as in
# ``kernels/context_kv.py``.


def _dot_acc(acc, w_rows, x_rows, offs_n, offs_m, k_start, M, N, K, stride_xk, K_ITERS: tl.constexpr,
             BLOCK_K: tl.constexpr, IEEE: tl.constexpr, MASK_W: tl.constexpr, EVICT_FIRST: tl.constexpr,
             W_FP8: tl.constexpr):
    # the dot path's K loop: acc[n, m] += W[n, k] x[m, k], K_ITERS steps of BLOCK_K from k_start,
    # in order, into acc (fp32 [BLOCK_N, M_PAD]); w_rows / x_rows: row pointers [BLOCK_N, 1] /
    # [M_PAD, 1]. The weight is the wide (MMA M-side) operand; Triton's pipeliner stages its loads.
    # W_FP8: the tile is e4m3, widened in registers (exact: e4m3's 3 mantissa bits fit bf16's 7
    # and fp16's 10; its exponents fit both) before the dot: 1, to x's dtype; 2 (x bf16,
    # FP8_DOT_F16), to fp16 with x rounded to fp16 too: e4m3 -> f16x2 is one instruction a pair
    # on sm_90, where bf16 takes a scalar f16 -> bf16 more an element. x to fp16 is exact for
    # |x| in [2^-14, 65504] (10 mantissa bits hold bf16's 7), saturated past it (the drafter's
    # fp8 inputs are RMS-normed: |x| <= sqrt(H) max|w|), flushed below 2^-24
    for i in range(K_ITERS):
        k0 = k_start + i * BLOCK_K
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        w = _load_w(w_rows + offs_k[None, :], (offs_n[:, None] < N) & (offs_k[None, :] < K),
                    MASK_W, EVICT_FIRST)
        x = tl.load(x_rows + offs_k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        acc = _dot_step(acc, w, x, IEEE, W_FP8)
    return acc


def _dot_step(acc, w, x, IEEE: tl.constexpr, W_FP8: tl.constexpr):
    # one K step of the dot path: acc [BLOCK_N, M_PAD] += w [BLOCK_N, BLOCK_K] x [M_PAD, BLOCK_K]^T,
    # the weight widened as _dot_acc's W_FP8 says
    # (one return: Triton builds the statements after a constexpr branch's return too)
    if IEEE:  # fp32 inputs (no tf32), and the interpreter (its bf16 dot is wrong)
        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    elif W_FP8 == 2:
        x16 = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        acc = tl.dot(w.to(tl.float16), tl.trans(x16), acc)
    elif W_FP8:
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    else:
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


def _load_w(ptrs, mask, MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr):
    # a weight tile; unmasked when the tiles divide N and K (no predicates, widest vectors)
    if MASKED:
        if EVICT_FIRST:
            w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if EVICT_FIRST:
            w = tl.load(ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(ptrs)
    return w


def _gemv_w_load(w_rows, k0, ok, offs_n, N, K, BLOCK_K: tl.constexpr, MASK_W: tl.constexpr,
                 EVICT_FIRST: tl.constexpr):
    # the weight tile [BLOCK_N, BLOCK_K] at k0; ok = False masks it off (a prefetch past the chunk)
    offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    return _load_w(w_rows + offs_k[None, :], (offs_n[:, None] < N) & (offs_k[None, :] < K) & ok,
                   MASK_W, EVICT_FIRST)


def _gemv_loads(
    w_rows, x_ptr, k0, ok, offs_n, zero_n, M, N, K, stride_xm, stride_xk,
    BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, MASK_W: tl.constexpr, EVICT_FIRST: tl.constexpr,
    X_BCAST: tl.constexpr,
):
    # the weight tile [BLOCK_N, BLOCK_K] at k0 and the x rows' slices (rows past M_PAD: row 0's,
    # unused); ok = False masks everything off (a prefetch past the chunk)
    w = _gemv_w_load(w_rows, k0, ok, offs_n, N, K, BLOCK_K, MASK_W, EVICT_FIRST)
    x0, x1, x2, x3 = _gemv_x_loads(x_ptr, k0, ok, zero_n, M, K, stride_xm, stride_xk, BLOCK_K,
                                   M_PAD, X_BCAST)
    return w, x0, x1, x2, x3


def _gemv_x_loads(x_ptr, k0, ok, zero_n, M, K, stride_xm, stride_xk, BLOCK_K: tl.constexpr,
                  M_PAD: tl.constexpr, X_BCAST: tl.constexpr):
    # the x rows' slices at k0 for _gemv_loads
    offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    if X_BCAST:
        # x rows loaded with the weight tile's shape (stride 0 along n): the same layout as w, no
        # shared-memory shuffle or barrier in the loop; the redundant lanes hit L1
        kk = offs_k[None, :] + zero_n
    else:
        # x rows as [BLOCK_K] vectors, broadcast after the load (the compiler spreads them
        # through shared memory: one store, a few loads, two barriers per step)
        kk = offs_k
    x0 = tl.load(x_ptr + kk * stride_xk, mask=(kk < K) & ok, other=0.0)
    x1 = x0
    x2 = x0
    x3 = x0
    if M_PAD > 1:
        x1 = tl.load(x_ptr + stride_xm + kk * stride_xk, mask=(kk < K) & (M > 1) & ok, other=0.0)
    if M_PAD > 2:
        x2 = tl.load(x_ptr + 2 * stride_xm + kk * stride_xk, mask=(kk < K) & (M > 2) & ok, other=0.0)
        x3 = tl.load(x_ptr + 3 * stride_xm + kk * stride_xk, mask=(kk < K) & (M > 3) & ok, other=0.0)
    return x0, x1, x2, x3


def _bcast(x, X_BCAST: tl.constexpr):
    # an x slice loaded as [BLOCK_N, BLOCK_K] (X_BCAST) or as [BLOCK_K], in fp32, ready to
    # multiply the weight tile
    if X_BCAST:
        v = x.to(tl.float32)
    else:
        v = x.to(tl.float32)[None, :]
    return v


def _weight_rows(offs_n, glu_inter, GLU: tl.constexpr):
    # the weight row of each row index (virtual with GLU) of a column tile
    if GLU:
        return (offs_n % 2) * glu_inter + offs_n // 2
    return offs_n


def _store_y(acc, y_ptr, stride_ym, pid_n, M, N, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
             OUT_DTYPE: tl.constexpr, GLU: tl.constexpr, LIBDEVICE: tl.constexpr):
    # y of column tile pid_n from acc [M_PAD, BLOCK_N] fp32, rounded once. GLU: virtual columns
    # 2c and 2c + 1 are the gate and up of output column c; each is rounded to the output dtype
    # as the unfused GEMM stores it, then y[m, c] = T(T(g / (1 + exp(-g))) * u) as
    # kernels/silu_mul.py computes it (libdevice's expf, a correctly rounded division), so y is
    # bitwise silu_mul(skinny_gemm(x, W)) under the same config. That kernel is built without
    # FMA contraction; this one keeps it for its GEMV FMAs, so the one add a contraction could
    # merge with exp's last product is an explicit round-to-nearest add (its flush of a
    # subnormal e cannot change 1 + e). The product s * u feeds only the rounding's integer ops
    # and the store: nothing to contract with.
    offs_mo = tl.arange(0, M_PAD)[:, None]
    if GLU:
        g, u = tl.split(tl.reshape(acc, [M_PAD, BLOCK_N // 2, 2]))
        g = _round_to(g, OUT_DTYPE)
        u = _round_to(u, OUT_DTYPE)
        if LIBDEVICE:
            one_plus_e = tl.extra.cuda.libdevice.add_rn(1.0, tl.extra.cuda.libdevice.exp(-g))
        else:  # the interpreter: numpy's exp, and no contraction
            one_plus_e = 1.0 + tl.exp(-g)
        h = _round_to(tl.math.div_rn(g, one_plus_e), OUT_DTYPE) * u
        offs_c = (pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2))[None, :]
        tl.store(y_ptr + offs_mo * stride_ym + offs_c, _round_to(h, OUT_DTYPE).to(y_ptr.dtype.element_ty),
                 mask=(offs_mo < M) & (offs_c < N // 2))
    else:
        offs_no = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        tl.store(y_ptr + offs_mo * stride_ym + offs_no, _round_to(acc, OUT_DTYPE).to(y_ptr.dtype.element_ty),
                 mask=(offs_mo < M) & (offs_no < N))


def _skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, scale_ptr,
    M, N, K, stride_xm, stride_xk, stride_wn, stride_ym, glu_inter,
    K_ITERS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr, MASK_W: tl.constexpr,
    EVICT_FIRST: tl.constexpr, X_BCAST: tl.constexpr, PREFETCH: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PART_ROWS: tl.constexpr, PDL: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    GLU: tl.constexpr, LIBDEVICE: tl.constexpr, W_FP8: tl.constexpr,
):
    # program (j, s): columns [j BLOCK_N, (j + 1) BLOCK_N), K chunk [s Ks, (s + 1) Ks) with
    # Ks = K_ITERS * BLOCK_K. The trip count is a constexpr (K is fixed per weight, and the
    # interpreter holds scalar arguments as arrays, which range() rejects).
    # ROW_BLOCKS (skinny_gemm_rows): program (b, j, s) runs the same on rows [16 b, 16 b + 16) of
    # x and y, with its own workspace slabs and counters; b varies fastest, so the programs of
    # one weight tile run together and all but the first read it from L2.
    # GLU (skinny_gemm(..., glu=True)): W is [2I, K] (gate rows, then up rows; glu_inter = I) and
    # N = 2I counts VIRTUAL rows v = 2c + h of weight row h I + c (_weight_rows): a column tile
    # holds the gate and up rows of BLOCK_N / 2 output columns, and the epilogue stores
    # silu(gate) * up of them into y [M, I] (_store_y)
    # W_FP8 (an e4m3 weight, skinny_gemm(..., scale=)): acc[n, m] = sum_k x[m, k] Wq[n, k] as
    # above (the e4m3 values are exact in fp32 and in x's dtype), then times the fp32 scale of
    # weight row n, before the split-K partials or the store
    if ROW_BLOCKS:
        pid_b = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        x_ptr += pid_b * PART_ROWS * stride_xm
        y_ptr += pid_b * PART_ROWS * stride_ym
        part_ptr += pid_b * SPLIT_K * PART_ROWS * N
        count_ptr += pid_b * ((N + 7) // 8)  # ceil(N / _MIN_BLOCK_N) counters a block
        M = tl.minimum(M - pid_b * PART_ROWS, PART_ROWS)
    else:
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_start = pid_k * (K_ITERS * BLOCK_K)

    if PDL and (USE_DOT or not PREFETCH):
        tl.extra.cuda.gdc_wait()  # launched early (programmatic dependent launch): x is ready now
    if USE_DOT:
        # acc[n, m] += W[n, k] x[m, k]: the weight is the wide (M-side) operand
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        w_rows = w_ptr + _weight_rows(offs_n, glu_inter, GLU)[:, None].to(tl.int64) * stride_wn
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        acc = _dot_acc(tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32), w_rows, x_rows, offs_n, offs_m,
                       k_start, M, N, K, stride_xk, K_ITERS, BLOCK_K, IEEE, MASK_W, EVICT_FIRST, W_FP8)
        out = tl.trans(acc)  # [M_PAD, BLOCK_N]
    else:
        # GEMV, M_PAD <= 4 rows: one [BLOCK_N, BLOCK_K] fp32 accumulator per row, all in the
        # weight tile's layout (one FMA per element and row; the K reduction once, at the end).
        # PREFETCH: the loads of step i + 1 are issued before the FMAs of step i (a register
        # double buffer; Triton's pipeliner only stages loads that feed tl.dot)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + _weight_rows(offs_n, glu_inter, GLU)[:, None].to(tl.int64) * stride_wn
        zero_n = offs_n[:, None] * 0
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if M_PAD > 1:
            acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if M_PAD > 2:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH:
            # PDL: the first weight tile is loaded while the previous kernel may still run (the
            # weights are never written in a forward); x, its output, only after gdc_wait
            w = _gemv_w_load(w_rows, k_start, True, offs_n, N, K, BLOCK_K, MASK_W, EVICT_FIRST)
            if PDL:
                tl.extra.cuda.gdc_wait()
            x0, x1, x2, x3 = _gemv_x_loads(x_ptr, k_start, True, zero_n, M, K, stride_xm, stride_xk,
                                           BLOCK_K, M_PAD, X_BCAST)
        for i in range(K_ITERS):
            if PREFETCH:
                cw, c0, c1, c2, c3 = w, x0, x1, x2, x3
                w, x0, x1, x2, x3 = _gemv_loads(
                    w_rows, x_ptr, k_start + (i + 1) * BLOCK_K, i + 1 < K_ITERS, offs_n, zero_n,
                    M, N, K, stride_xm, stride_xk, BLOCK_K, M_PAD, True, EVICT_FIRST, X_BCAST)
            else:
                cw, c0, c1, c2, c3 = _gemv_loads(
                    w_rows, x_ptr, k_start + i * BLOCK_K, True, offs_n, zero_n, M, N, K,
                    stride_xm, stride_xk, BLOCK_K, M_PAD, MASK_W, EVICT_FIRST, X_BCAST)
            cw = cw.to(tl.float32)
            acc0 += cw * _bcast(c0, X_BCAST)
            if M_PAD > 1:
                acc1 += cw * _bcast(c1, X_BCAST)
            if M_PAD > 2:
                acc2 += cw * _bcast(c2, X_BCAST)
                acc3 += cw * _bcast(c3, X_BCAST)
        rows = tl.arange(0, M_PAD)[:, None]
        out = tl.where(rows == 0, tl.sum(acc0, axis=1)[None, :], 0.0)  # [M_PAD, BLOCK_N]
        if M_PAD > 1:
            out = tl.where(rows == 1, tl.sum(acc1, axis=1)[None, :], out)
        if M_PAD > 2:
            out = tl.where(rows == 2, tl.sum(acc2, axis=1)[None, :], out)
            out = tl.where(rows == 3, tl.sum(acc3, axis=1)[None, :], out)

    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the weights are read: let the next kernel start
    if W_FP8:  # the per-row scales, once a column (weight rows: _weight_rows)
        offs_ns = n0 + tl.arange(0, BLOCK_N)
        row_scale = tl.load(scale_ptr + _weight_rows(offs_ns, glu_inter, GLU), mask=offs_ns < N, other=0.0)
        out = out * row_scale[None, :]
    offs_mo = tl.arange(0, M_PAD)[:, None]
    offs_no = (n0 + tl.arange(0, BLOCK_N))[None, :]
    o_mask = (offs_mo < M) & (offs_no < N)
    if SPLIT_K == 1:
        _store_y(out, y_ptr, stride_ym, pid_n, M, N, M_PAD, BLOCK_N, OUT_DTYPE, GLU, LIBDEVICE)
    else:
        # partial -> part[pid_k, m, n]; the last of the SPLIT_K programs of this column tile sums
        # the slabs in split order, stores y and re-arms the counter (module docstring)
        part = part_ptr + offs_mo * N + offs_no
        tl.store(part + pid_k * (PART_ROWS * N), out, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * (PART_ROWS * N), mask=o_mask, other=0.0,
                                 cache_modifier=".cg")
            _store_y(total, y_ptr, stride_ym, pid_n, M, N, M_PAD, BLOCK_N, OUT_DTYPE, GLU, LIBDEVICE)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key; triton reads the environment)."""
    del interpret
    namespace = jit_functions(__name__, (_round_to, _load_w, _dot_step, _dot_acc, _gemv_w_load, _gemv_x_loads, _gemv_loads,
                                         _bcast, _weight_rows, _store_y, _skinny_gemm_kernel))
    return namespace["_skinny_gemm_kernel"]


# ---- split-K workspace ------------------------------------------------------------------------------

_WORKSPACES: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = register_state({})


_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = register_state([])  # outgrown workspaces graphs may still use


def _workspace(device: torch.device, n: int, split_k: int,
               row_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials ``[blocks * split_k, 16, n]`` fp32, counters ``[blocks * ceil(n / 8)]`` int32
    zeros) for one ``(device, n, split_k)`` with room for at least ``row_blocks`` 16-row blocks
    (:func:`skinny_gemm_rows`; 1 for :func:`skinny_gemm`), allocated once and kept (graphs may
    point at them: one outgrown by a larger call is retired, never freed)."""
    key = (device, n, split_k)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].shape[0] < row_blocks * split_k:
        if ws is not None:
            _RETIRED.append(ws)
        blocks = 1 if row_blocks == 1 else MAX_ROW_BLOCKS
        part = torch.empty((blocks * split_k, MAX_M, n), dtype=torch.float32, device=device)
        counters = torch.zeros(blocks * _cdiv(n, _MIN_BLOCK_N), dtype=torch.int32, device=device)
        ws = _WORKSPACES[key] = (part, counters)
    return ws


# ---- host side --------------------------------------------------------------------------------------


def _is_pow2(v: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _check_config(cfg: SkinnyConfig, use_dot: bool, m: int) -> None:
    if not isinstance(cfg, SkinnyConfig):
        raise ValueError(f"config must be a SkinnyConfig or None, got {type(cfg).__name__}")
    if not use_dot and m > _MAX_GEMV_M:
        raise ValueError(f"config.use_dot=False (GEMV) supports M <= {_MAX_GEMV_M}, got M={m}; "
                         "use use_dot=True or None")
    lo_n = 16 if use_dot else _MIN_BLOCK_N
    if not (_is_pow2(cfg.block_n) and lo_n <= cfg.block_n <= 1024):
        raise ValueError(f"config.block_n must be a power of two in [{lo_n}, 1024]"
                         f"{' (tl.dot path)' if use_dot else ''}, got {cfg.block_n!r}")
    if not (_is_pow2(cfg.block_k) and 16 <= cfg.block_k <= 4096):
        raise ValueError(f"config.block_k must be a power of two in [16, 4096], got {cfg.block_k!r}")
    if isinstance(cfg.split_k, bool) or not isinstance(cfg.split_k, int) or not 1 <= cfg.split_k <= 64:
        raise ValueError(f"config.split_k must be an int in [1, 64], got {cfg.split_k!r}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config.num_warps must be 1, 2, 4, 8 or 16, got {cfg.num_warps!r}")
    if isinstance(cfg.num_stages, bool) or not isinstance(cfg.num_stages, int) or cfg.num_stages < 1:
        raise ValueError(f"config.num_stages must be an int >= 1, got {cfg.num_stages!r}")


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K], got shape {tuple(getattr(x, 'shape', ()))}; "
                         "flatten the leading dims first")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [N, K], got shape "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"x has M={x.shape[0]} rows; skinny_gemm supports M <= {MAX_M} "
                         "(use F.linear for larger batches)")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K={x.shape[1]}] and weight [N, K={weight.shape[1]}] disagree on K")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if weight.dtype in QUANT_DTYPES:
        if scale is None:
            raise ValueError(f"a {weight.dtype} weight needs scale= (its per-row fp32 scales [N]); "
                             "quantize with models/fp8.py quantize_rows or greedy_lm_head.quantize")
        if (not isinstance(scale, torch.Tensor) or scale.shape != (weight.shape[0],)
                or scale.dtype != torch.float32 or not scale.is_contiguous() or scale.device != x.device):
            raise ValueError(f"scale must be a contiguous float32 tensor [N={weight.shape[0]}] on "
                             f"{x.device}, got {getattr(scale, 'dtype', type(scale).__name__)} "
                             f"{tuple(getattr(scale, 'shape', ()))}")
    elif scale is not None:
        raise ValueError(f"scale= is for float8_e4m3fn / int8 weights; this weight is {weight.dtype} (drop scale)")
    elif weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}; cast one")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}; move them to one device")
    if weight.stride(1) != 1 and weight.shape[1] > 1:
        raise ValueError(f"weight must have unit column stride (e.g. contiguous), got strides "
                         f"{tuple(weight.stride())}; pass weight.contiguous()")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None,
                glu: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T`` for at most 16 rows in one Triton launch (see the module docstring);
    with ``glu``, the SwiGLU of it in the same launch.

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16, ``M <= 16``, any strides.
        weight: ``[N, K]`` of x's dtype and device, unit column stride (any row stride); or
            ``float8_e4m3fn`` or ``int8`` with ``scale``.
        config: tiles and launch options; ``None``: :func:`default_config` ``(M, N, K)``.
        glu: ``weight`` is a SwiGLU MLP's ``gate_up [2I, K]`` (gate rows first, ``N = 2I`` even)
            and the result is ``silu(x W_gate^T) * (x W_up^T)`` ``[M, I]``: bitwise
            ``kernels.silu_mul.silu_mul(skinny_gemm(x, weight, config))`` (the gate and up rows
            of an output column share a column tile; the activation is the epilogue), without
            the second launch and the ``[M, 2I]`` round trip. Same config table (the gate_up's).
        scale: ``[N]`` fp32, with an e4m3 ``weight`` only: row ``n`` stands for
            ``scale[n] * weight[n]`` (per output row, as ``models/fp8.py`` quantizes). The weight
            streams at one byte an element; each tile is widened to x's dtype in registers
            (exact) and the fp32 sum of row ``n`` is multiplied by ``scale[n]`` before the
            rounding (with ``glu``: before the activation).

    Returns:
        ``[M, N]`` (``[M, N / 2]`` with ``glu``) contiguous in x.dtype: ``F.linear(x, weight)``
        up to the fp32 accumulation order (fp32 accumulation; one rounding at the end). Bitwise
        reproducible for a given config. Runs where :func:`is_available` says (CUDA sm80+, or a
        CPU under the interpreter); check :func:`can_use` first to fall back to ``F.linear``.
    """
    _check(x, weight, scale)
    m, k = x.shape
    n = weight.shape[0]
    is_fp8 = scale is not None
    if glu and n % 2:
        raise ValueError(f"glu=True needs weight [2I, K] (gate rows, then up rows), got {n} rows: "
                         "an odd count; pass the fused gate_up weight")
    cfg = default_config(m, n, k, fp8=is_fp8, int8=weight.dtype == torch.int8) if config is None else config
    if not isinstance(cfg, SkinnyConfig):
        raise ValueError(f"config must be a SkinnyConfig or None, got {type(cfg).__name__}")
    y = torch.empty((m, n // 2 if glu else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        _check_config(cfg, _use_dot(cfg, m), m)
        return y.zero_()  # with glu and K = 0: gate = up = 0, silu(0) * 0 = 0
    interpret = interpret_mode()
    grid, split_k, meta = _plan(m, n, k, x.dtype, cfg, interpret, pdl.active(x.device, interpret),
                                glu=glu, w_fp8=fp8_mode(is_fp8, x.dtype, weight.dtype))
    if split_k > 1:
        part, counters = _workspace(x.device, n, split_k)
    else:
        part = counters = y  # unused
    _kernels(interpret)[grid](
        x, weight, y, part, counters, scale if is_fp8 else y,
        m, n, k, x.stride(0), x.stride(1), weight.stride(0), y.stride(0), n // 2,
        **meta,
    )
    return y


def skinny_gemm_rows(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T`` for up to ``MAX_ROW_BLOCKS * 16`` rows in ONE launch: the tensor-core
    path of :func:`skinny_gemm` (``config.use_dot`` must not be False) on each 16-row block of
    x, the blocks on a grid axis of their own. Each block is computed exactly as
    :func:`skinny_gemm` computes those rows alone with ``config`` (same tiles, same split-K
    order), so a row's result does not depend on the rows around it (kernels/batch_invariant.py);
    and the blocks of one weight tile run together, reading it from HBM about once.

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16, ``M <= MAX_ROW_BLOCKS * 16``, any strides.
        weight: ``[N, K]`` of x's dtype and device, unit column stride; or ``float8_e4m3fn`` / ``int8``
            with ``scale [N]`` fp32 (as :func:`skinny_gemm`).
        config: tiles and launch options (the dot path).

    Returns:
        ``[M, N]`` contiguous in x.dtype.
    """
    m = x.shape[0] if x.dim() == 2 else -1
    if not 0 <= m <= MAX_ROW_BLOCKS * MAX_M:
        raise ValueError(f"skinny_gemm_rows takes x [M, K] with M <= {MAX_ROW_BLOCKS * MAX_M}, got "
                         f"{tuple(x.shape)}; split the rows")
    if config.use_dot is False:
        raise ValueError("skinny_gemm_rows runs the tensor-core path only; pass a config with use_dot=True")
    _check(x[:MAX_M], weight, scale)
    k, n = x.shape[1], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return y.zero_()
    blocks = _cdiv(m, MAX_M)
    interpret = interpret_mode()
    grid, split_k, meta = _plan(m, n, k, x.dtype, config, interpret, pdl.active(x.device, interpret),
                                row_blocks=blocks, w_fp8=fp8_mode(scale is not None, x.dtype, weight.dtype))
    part, counters = _workspace(x.device, n, split_k, blocks) if split_k > 1 else (y, y)
    _kernels(interpret)[grid](
        x, weight, y, part, counters, scale if scale is not None else y,
        m, n, k, x.stride(0), x.stride(1), weight.stride(0), y.stride(0), 0,
        **meta,
    )
    return y


# The dot path's e4m3 weight tiles widen to fp16 (x rounded to fp16) where x is bf16: half the
# conversions of widening to bf16 (the kernel's _dot_acc). False: to x's dtype (an A/B knob).
FP8_DOT_F16 = True


def fp8_mode(is_fp8: bool, dtype: torch.dtype, weight_dtype: torch.dtype = FP8_DTYPE) -> int:
    """The kernel's ``W_FP8``: 0 (the weight in x's dtype), 1 (a one-byte weight widened to x's
    dtype), 2 (e4m3 and a bf16 x both to fp16 for the dot: :data:`FP8_DOT_F16`). An int8 weight
    always takes 1: x is never rounded (kernels/greedy_lm_head.py bounds the error of exact
    products)."""
    if not is_fp8:
        return 0
    return 2 if FP8_DOT_F16 and dtype == torch.bfloat16 and weight_dtype == FP8_DTYPE else 1


def _use_dot(cfg: SkinnyConfig, m: int) -> bool:
    return _dot_auto(m) if cfg.use_dot is None else bool(cfg.use_dot)


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, dtype: torch.dtype, cfg: SkinnyConfig,
          interpret: bool, pdl: bool = False, row_blocks: int = 0,
          glu: bool = False, w_fp8: int = 0) -> tuple[tuple[int, ...], int, dict]:
    """(grid, effective split_k, constexpr and launch keywords) of one call; validates ``cfg``
    (cached per shape and config: the eager host path is a dict lookup and one launch).
    ``row_blocks`` > 0: a :func:`skinny_gemm_rows` launch over that many 16-row blocks; ``glu``:
    the SwiGLU epilogue of :func:`skinny_gemm`; ``w_fp8``: an e4m3 weight with row scales
    (:func:`fp8_mode`)."""
    use_dot = True if row_blocks else _use_dot(cfg, m)
    _check_config(cfg, use_dot, m)
    block_k = cfg.block_k
    k_per_split = _cdiv(_cdiv(k, cfg.split_k), block_k) * block_k  # K / split up to BLOCK_K
    split_k = _cdiv(k, k_per_split)  # drop chunks that would start past K
    meta = dict(
        K_ITERS=k_per_split // block_k, M_PAD=16 if use_dot else _next_pow2(m),
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        USE_DOT=use_dot, IEEE=use_dot and (dtype == torch.float32 or interpret),
        MASK_W=n % cfg.block_n != 0 or k != split_k * k_per_split,
        EVICT_FIRST=bool(cfg.evict_first), X_BCAST=bool(cfg.x_bcast),
        PREFETCH=not use_dot and cfg.num_stages > 1,
        OUT_DTYPE=DTYPE_CODE[dtype], PART_ROWS=MAX_M, PDL=pdl, ROW_BLOCKS=row_blocks > 0,
        GLU=bool(glu), LIBDEVICE=not interpret, W_FP8=int(w_fp8),
        num_warps=cfg.num_warps, num_stages=_dot_stages(cfg, dtype) if use_dot else cfg.num_stages,
        **launch_options(pdl),
    )
    if row_blocks:
        return (row_blocks, _cdiv(n, cfg.block_n), split_k), split_k, meta
    return (_cdiv(n, cfg.block_n), split_k), split_k, meta


# Shared memory the fp32 dot path may pipeline through (the H200 gives a program at most 227 KiB).
_FP32_DOT_SMEM_BUDGET = 192 * 1024


def _dot_stages(cfg: SkinnyConfig, dtype: torch.dtype) -> int:
    """``num_stages`` of a dot-path launch. The measured configs are bf16's; with fp32 operands
    Triton's pipeline keeps ``num_stages - 1`` weight and x tiles of 4-byte elements in shared
    memory, ``(stages - 1) (block_n + 16) block_k 4`` bytes (the sm_90 build's own count), which
    for the 64 x 256, 4-stage configs is 240 KiB: more than a program may have, so a float32
    engine at Laguna widths failed its graph capture. Capped to the budget there; bf16 / fp16
    unchanged."""
    if dtype != torch.float32:
        return cfg.num_stages
    per_stage = (cfg.block_n + 16) * cfg.block_k * 4
    return max(1, min(cfg.num_stages, 1 + _FP32_DOT_SMEM_BUDGET // per_stage))
