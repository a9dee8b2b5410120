"""GEMV ``y = x @ W^T`` for 1-4 rows that parks its weight in shared memory before the PDL wait.

For ``x [M, K]`` (``M <= 4``) and ``W [N, K]`` (bf16 / fp16)::

    y[m, n] = sum_k x[m, k] * W[n, k]          fp32 accumulation, y rounded once to x.dtype

Why (docs/PERFORMANCE.md, thirteenth pass): in the batch-1 decode step ``o_proj`` follows two
latency-bound kernels (attention, the split merge) during which the HBM idles. With programmatic
dependent launch its programs can be resident while those run, but the skinny GEMM
(kernels/skinny_gemm.py) holds only one register tile a program before its wait. Here a program
loads its first ``STAGES`` weight stages before ``griddepcontrol.wait`` and parks them in shared
memory (registers only carry the four stages in flight), so up to ~80 KiB a program, 160 KiB an
SM, stream in while the previous kernels run. After the wait it loads x, sums the parked stages,
then streams the rest through registers, four stages ahead. On the H200 this took o_proj's span
from ~9.5 to ~6.5 us a layer when attention and the merge signal early (paged_attention's
``early_signal``), 2.22 -> 2.19 ms for the decode graph.

Grid ``N / BLOCK_N``: program ``j`` owns rows ``[j BLOCK_N, (j + 1) BLOCK_N)`` over all of K (no
split-K, no workspace). A stage is ``[BLOCK_N, STAGE_K]``, ``NUM_K = K / STAGE_K`` of them. Weight
loads are ``evict_first`` (each byte is read once: measured, a weight stream left at the default
L2 priority slowed the next layers' attention by ~1 us a layer). Each thread stores and later reads
back exactly the bytes it loaded (one register layout for both), so no barrier guards the parked
stages (the tensor-core kernel reads them in the mma operand layout, after one barrier). Three
kernels:

* one row (``M = 1``, the batch-1 decode's o_proj, the engine's default): x goes through shared
  memory once (one barrier); one accumulator ``[BLOCK_N, STAGE_K]`` fp32 in the weight tile's
  layout (one FMA per weight element); the K reduction once, at the end.
* 2-4 rows on CUDA cores (for the K = 3 verify's and the drafter block's o_proj, as the
  tensor-core kernel below; ``layers.staged_o_proj_max_rows`` turns them on, off until timed):
  the same weight side, but a stage is viewed ``[BLOCK_N, STAGE_K / 8, 8]`` (a thread's 16-byte
  vector on the last axis), each row of x is read from global memory (L1 / L2; a stage ahead)
  instead of shared memory, and row ``m`` keeps ``acc_m [BLOCK_N, STAGE_K / 8]`` fp32, to which
  each step adds the sum of a vector's 8 products (in order). Shared memory then holds only the
  parked weight, as much a program as the one-row kernel (64 KiB at 8 x 256, 16 parked, 2
  warps), and ptxas gives it 238 registers at 4 rows: two programs an SM, as the one-row kernel
  runs next to attention. The
  first 2-4 row design kept four rows of x in shared memory next to full-size accumulators
  (201-255 registers, 96-192 KiB, one program an SM) and lost in every config in the 4-token
  verify graph (docs/PERFORMANCE.md, fourteenth and sixty-third passes).
* 1-4 rows on the tensor cores (``StagedConfig.tensor_cores``; the default 2-4 row config): the
  CUDA-core kernels spend an FMA per weight element and row plus conversions, all after the
  wait, ~8 SASS instructions a weight element at 4 rows. Here a program owns 16 weight rows (one
  ``mma.sync m16n8k16`` tile) and a stage is ``[num_warps, 16, STAGE_K]``: warp ``w`` takes the
  K slice ``w`` of it, parked (16-byte chunks XOR-swizzled, so ``ldmatrix`` reads them without
  bank conflicts) or in flight as above, and multiplies it by ``x^T [STAGE_K, 8]`` (x's rows
  read from global memory, rows past M as zeros) into its own ``[16, 8]`` fp32 accumulator (a
  batched dot over the warps); the warps' accumulators are summed once at the end. 1.18 SASS
  instructions a weight element after the wait (4 rows, 16 x (4 x 128) stages, 246 registers).

The grid and every launch argument depend only on the shapes and the config: CUDA-graph
capturable, no host sync. Every kernel sums in fp32 and rounds y once; each is bitwise
reproducible for a config, and the three give different summation orders.

Written in Gluon (triton.experimental.gluon, pinned with triton 3.6), which exposes shared
memory; it has no interpreter: CPU tests check the sm_90 build offline and the values of the
kernels' Python bodies run on torch tensors (tests/gluon_emulator.py: the index arithmetic,
masks, staging and stores, not the compiler or races), GPU tests the values against an fp64
reference (tests/test_kernel_staged_gemv.py). Other ways of filling the stages
(TMA boxes, ``cp.async``) measured slower in the decode graph; they are on the branch
``exp/staged-o-proj``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import pdl

__all__ = ["MAX_M", "StagedConfig", "can_use", "default_config", "staged_gemv", "staged_gemv_reference",
           "supports"]

MAX_M = 4  # rows of x (one fp32 accumulator each)

_DTYPES = (torch.bfloat16, torch.float16)
_MAX_SMEM = 220 * 1024  # of the 227 KiB a program may have on sm_90
_MIN_ROWS_STAGE_K = 256  # the rows kernel: a stage spans the 32 lanes' 16-byte vectors


@dataclass(frozen=True)
class StagedConfig:
    """Launch configuration of :func:`staged_gemv`.

    Attributes:
        block_n: weight rows per program (a power of two in [8, 64]; 16 with ``tensor_cores``).
        stage_k: K elements of one stage (a power of two, >= 64; 16-byte loads a thread); with
            ``tensor_cores`` those of one warp's slice of a stage (>= 16).
        stages: stages parked in shared memory before the PDL wait.
        num_warps: warps per program.
        tensor_cores: the tensor-core kernel (module docstring): a stage is ``num_warps x
            stage_k`` columns, warp ``w`` multiplies slice ``w`` of it with ``mma.sync``; its
            parked stages are the largest power of two <= ``stages`` (a layout constraint).
    """

    block_n: int = 8
    stage_k: int = 512
    stages: int = 8
    num_warps: int = 4
    tensor_cores: bool = False

    @property
    def stage_cols(self) -> int:
        """K columns of one stage."""
        return self.stage_k * (self.num_warps if self.tensor_cores else 1)

    def parked(self, k: int) -> int:
        """Stages parked before the wait for a K of ``k`` columns."""
        parked = min(self.stages, -(-k // self.stage_cols))
        return 1 << (parked.bit_length() - 1) if self.tensor_cores and parked > 0 else parked

    def smem_bytes(self, k: int, m: int = 1, elem_bytes: int = 2) -> int:
        """Shared memory a program needs: the parked stages, plus for one row x (as ``K /
        stage_k`` rows of a stage, padded to a power of two; the 2-4 row kernels read x from
        global memory), plus for the tensor-core kernel a stage of scratch (a streamed stage's
        change of register layout)."""
        num_k = -(-k // self.stage_cols)
        parked = self.parked(k)
        if self.tensor_cores:
            return (parked + 1) * self.block_n * self.stage_cols * elem_bytes
        x_rows = _next_pow2(num_k) if m == 1 else 0
        return (parked * self.block_n + x_rows) * self.stage_k * elem_bytes


# 2-4 rows: (block_n, stage_k, stages, num_warps[, tensor_cores]). Both 2-4 row kernels lost in
# the graphs (gpu_check.sh pass102, sixty-sixth pass: 4-token verify 3.79-3.81 ms on the tensor
# cores, 4.52-4.55 on CUDA cores, against 3.68 with the skinny GEMM), so o_proj takes them only
# where models/layers.py's staged_o_proj_max_rows is raised. Offline (ptxas / cuobjdump, sm_90a, 4 rows, K =
# 8192), SASS instructions a weight element after the PDL wait, where all of the 2-4 row work
# happens (the parked stages need x): the tensor-core kernel, 16 x (4 warps x 128) stages, 8
# parked (128 KiB, and 16 KiB of scratch; 128 programs for N = 2048, one an SM), 246 registers:
# 1.18 (16 x (4 x 64), 16 parked: 144 registers, 1.25, but half the bytes in flight a program
# while it streams the unparked stages: 4 x 8 KiB, estimated ~2.7 TB/s over 128 SMs at an
# assumed ~1.5 us of latency, where 4 x 16 KiB would cover the copy rate); the CUDA-core
# kernel, 8 x 256 stages, 16 parked, 2 warps (64 KiB, two programs an SM), 238 registers: 7.96
# (~4 us of issue for an XS-2.1 o_proj on 132 SMs, against ~1.8 us for the one-row kernel at one
# row), 9.6 with 8 x 512 x 4 warps. The first 2-4 row kernel kept four rows of x in shared
# memory next to full-size accumulators (one program an SM, 9.3 instructions a weight element)
# and lost in every config (fourteenth and sixty-third passes, docs/PERFORMANCE.md).
MULTI_ROW_CONFIG: tuple = (16, 128, 8, 4, True)
# One row (the decode's o_proj): 8 x 512 stages, 8 parked (64 KiB), 4 warps: two programs an SM
# next to attention (thirteenth pass, docs/PERFORMANCE.md). 10 and 12 parked stages made the
# decode replay 0.03-0.04 ms slower (nineteenth pass): they crowd out attention and the merge.
ONE_ROW_CONFIG: tuple[int, int, int, int] = (8, 512, 8, 4)


def default_config(n: int, k: int, m: int = 1) -> StagedConfig:
    """One row: the measured o_proj config (2048 x 8192 and 2048 x 6144 on the H200: 8 x 512
    stages, 8 parked, 4 warps). 2-4 rows: :data:`MULTI_ROW_CONFIG`. The stage narrowed to divide
    smaller K (down to 64; the 2-4 row CUDA-core kernel 256, the tensor-core one 16 a warp)."""
    del n
    cfg = StagedConfig(*(ONE_ROW_CONFIG if m <= 1 else MULTI_ROW_CONFIG))
    min_stage_k = 16 if cfg.tensor_cores else 64 if m <= 1 else _MIN_ROWS_STAGE_K
    while cfg.stage_k > min_stage_k and k % cfg.stage_cols:
        cfg = dataclasses.replace(cfg, stage_k=cfg.stage_k // 2)
    return cfg


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


@functools.cache
def _has_gluon() -> bool:
    """triton's Gluon dialect with what the kernel uses (triton 3.6 has it; older ones do not)."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: F401
    except ImportError:
        return False
    return all(hasattr(gl, a) for a in ("allocate_shared_memory", "SwizzledSharedLayout", "BlockedLayout",
                                        "NVMMADistributedLayout", "DotOperandLayout"))


def supports(weight: torch.Tensor, config: StagedConfig | None = None, m: int = 1) -> bool:
    """Whether :func:`staged_gemv` runs with ``weight [N, K]`` and an x of ``m`` rows (of its
    dtype, on its device): CUDA sm_90+ with triton's Gluon, bf16 / fp16, contiguous and 16-byte
    aligned, ``1 <= m <= MAX_M``, N a multiple of ``block_n``, K of ``stage_k``, the parked stages
    and x within a program's shared memory."""
    if not 1 <= m <= MAX_M:
        return False
    if not weight.is_cuda or weight.dim() != 2 or weight.dtype not in _DTYPES or not _has_gluon():
        return False
    if torch.cuda.get_device_capability(weight.device) < (9, 0):
        return False
    n, k = weight.shape
    cfg = config or default_config(n, k, m)
    if cfg.tensor_cores:  # one 16-row mma tile a program, each warp's slice whole k16 steps
        kernel_ok = cfg.block_n == 16 and cfg.stage_k >= 16
    else:  # the 2-4 row kernel: a stage spans the 32 lanes' 16-byte vectors
        kernel_ok = m == 1 or cfg.stage_k >= _MIN_ROWS_STAGE_K
    return (weight.is_contiguous() and weight.data_ptr() % 16 == 0 and n > 0 and k > 0 and kernel_ok
            and n % cfg.block_n == 0 and k % cfg.stage_cols == 0 and cfg.smem_bytes(k, m) <= _MAX_SMEM)


def can_use(x: torch.Tensor, weight: torch.Tensor, config: StagedConfig | None = None) -> bool:
    """:func:`supports` ``weight`` for x's rows, and x is ``[M, K]`` of its dtype and device with
    unit column stride."""
    return (x.dim() == 2 and x.shape[1] == weight.shape[-1] and x.stride(1) == 1
            and x.dtype == weight.dtype and x.device == weight.device
            and supports(weight, config, x.shape[0]))


def staged_gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``: ``[1, K] @ [N, K]^T -> [1, N]``."""
    return F.linear(x, weight)


@functools.cache
def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _stage_load(w_tile, i, STAGE_K: gl.constexpr, NUM_K: gl.constexpr, like):
        # stage i of the program's rows into registers (evict_first: each weight byte is read
        # once), or zeros past the last stage (a placeholder the rotation never consumes)
        if i < NUM_K:
            v = gl.load(w_tile + i * STAGE_K, eviction_policy="evict_first")
        else:
            v = gl.zeros_like(like)
        return v

    @gluon.jit
    def _next_stage(q0, q1, q2, q3, w_tile, i, STAGE, NUM_K):
        # (the stage in q0, the three behind it, stage i + 4's loads): the four in flight move on
        # (STAGE and NUM_K reach _stage_load as the constexprs they are)
        return q0, q1, q2, q3, _stage_load(w_tile, i + 4, STAGE, NUM_K, q0)

    @gluon.jit
    def _park(parked, w_tile, PRE: gl.constexpr, STAGE: gl.constexpr, NUM_K: gl.constexpr,
              GROUP: gl.constexpr):
        # stages 0 .. PRE - 1 into the parked buffer (entry i, or GROUP entries from i GROUP when
        # GROUP > 0), stages PRE .. PRE + 3 left in flight (returned). The weight is never
        # written in a forward (kernels/pdl.py rule 3): this runs before the PDL wait
        q0 = gl.load(w_tile, eviction_policy="evict_first")
        q1 = _stage_load(w_tile, 1, STAGE, NUM_K, q0)
        q2 = _stage_load(w_tile, 2, STAGE, NUM_K, q0)
        q3 = _stage_load(w_tile, 3, STAGE, NUM_K, q0)
        for i in gl.static_range(PRE):
            w, q0, q1, q2, q3 = _next_stage(q0, q1, q2, q3, w_tile, i, STAGE, NUM_K)
            if GROUP > 0:
                parked.slice(i * GROUP, GROUP).store(w)
            else:
                parked.index(i).store(w)
        return q0, q1, q2, q3

    @gluon.jit
    def _x_to_shared(x_ptr, m, stride_xm, xr, cols, STAGE_K: gl.constexpr, NUM_K: gl.constexpr,
                     X_ROWS: gl.constexpr, flat: gl.constexpr):
        # row m of x [K] -> shared [X_ROWS, STAGE_K] (NUM_K rows of a stage each, padded)
        xv = gl.load(x_ptr + m * stride_xm + xr[:, None] * STAGE_K + cols[None, :],
                     mask=xr[:, None] < NUM_K, other=0.0)
        return gl.allocate_shared_memory(xv.dtype, [X_ROWS, STAGE_K], flat, xv)

    @gluon.jit
    def _store_row(y_ptr, m, stride_ym, rows, acc):
        out = gl.sum(acc, axis=1)  # [BLOCK_N], row m of y
        gl.store(y_ptr + m * stride_ym + rows, out.to(y_ptr.dtype.element_ty))

    @gluon.jit
    def _staged_gemv_kernel(
        w_ptr, x_ptr, y_ptr, stride_xm, stride_ym, K: gl.constexpr, M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGE_K: gl.constexpr, STAGES: gl.constexpr, NUM_K: gl.constexpr,
        X_ROWS: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        # one row of x (M = 1): stages 0 .. PRE - 1 parked in shared memory before the wait, the
        # rest consumed from registers after it; q0..q3 always hold the next four stages' loads
        # (in flight); x in shared memory, one accumulator [BLOCK_N, STAGE_K]
        PRE: gl.constexpr = STAGES if STAGES < NUM_K else NUM_K
        n0 = gl.program_id(0) * BLOCK_N
        w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
        cols = gl.arange(0, STAGE_K, layout=gl.SliceLayout(0, w_layout))
        w_tile = w_ptr + rows[:, None].to(gl.int64) * K + cols[None, :]
        parked = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [PRE, BLOCK_N, STAGE_K], flat)
        q0, q1, q2, q3 = _park(parked, w_tile, PRE, STAGE_K, NUM_K, 0)
        if PDL:
            _gdc_wait()  # x is the previous kernel's output
        xr = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, w_layout))
        x0 = _x_to_shared(x_ptr, 0, stride_xm, xr, cols, STAGE_K, NUM_K, X_ROWS, flat)
        acc0 = gl.zeros([BLOCK_N, STAGE_K], gl.float32, w_layout)
        gl.thread_barrier()  # x in shared memory, written by every thread
        for i in gl.static_range(PRE):
            wf = parked.index(i).load(w_layout).to(gl.float32)
            acc0 += wf * x0.slice(i, 1).load(w_layout).to(gl.float32)
        for i in gl.static_range(PRE, NUM_K):
            w, q0, q1, q2, q3 = _next_stage(q0, q1, q2, q3, w_tile, i, STAGE_K, NUM_K)
            acc0 += w.to(gl.float32) * x0.slice(i, 1).load(w_layout).to(gl.float32)
        if PDL:
            _gdc_launch_dependents()  # the weights are read
        _store_row(y_ptr, 0, stride_ym, rows, acc0)

    @gluon.jit
    def _x_stage(x_ptr, m, stride_xm, i, x_offs, STAGE_K: gl.constexpr, NUM_K: gl.constexpr, like):
        # row m's K slice of stage i, [STAGE_K / 8, 8] (a placeholder past the last stage)
        if i < NUM_K:
            v = gl.load(x_ptr + m * stride_xm + i * STAGE_K + x_offs)
        else:
            v = like
        return v

    @gluon.jit
    def _dot_rows(wf, c0, c1, c2, c3, acc0, acc1, acc2, acc3, M: gl.constexpr):
        # acc_m [BLOCK_N, STAGE_K / 8] += the sum over each thread's 8 columns of wf * x_m
        acc0 += gl.sum(wf * gl.expand_dims(c0.to(gl.float32), 0), axis=2)
        if M > 1:
            acc1 += gl.sum(wf * gl.expand_dims(c1.to(gl.float32), 0), axis=2)
        if M > 2:
            acc2 += gl.sum(wf * gl.expand_dims(c2.to(gl.float32), 0), axis=2)
        if M > 3:
            acc3 += gl.sum(wf * gl.expand_dims(c3.to(gl.float32), 0), axis=2)
        return acc0, acc1, acc2, acc3

    @gluon.jit
    def _staged_rows_kernel(
        w_ptr, x_ptr, y_ptr, stride_xm, stride_ym, K: gl.constexpr, M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGE_K: gl.constexpr, STAGES: gl.constexpr, NUM_K: gl.constexpr,
        PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        # 2-4 rows of x: the weight side as the one-row kernel (PRE stages parked before the wait,
        # q0..q3 in flight), but a stage is viewed [BLOCK_N, STAGE_K / 8, 8] (each thread's
        # 16-byte vector on the last axis) and x is read from global memory (L1 / L2: it is a few
        # KiB), one stage ahead, not parked: shared memory holds only weights, as much a program
        # as the one-row kernel. Row m accumulates acc_m [BLOCK_N, STAGE_K / 8] += the sum over
        # the vector axis of w * x_m: 1/8 of the one-row kernel's accumulator a row, so four
        # rows fit the registers of two programs an SM.
        PRE: gl.constexpr = STAGES if STAGES < NUM_K else NUM_K
        SUB: gl.constexpr = STAGE_K // 8
        w3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0])
        acc_l: gl.constexpr = gl.SliceLayout(2, w3)
        x_l: gl.constexpr = gl.SliceLayout(0, w3)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        n0 = gl.program_id(0) * BLOCK_N
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
        subs = gl.arange(0, SUB, layout=gl.SliceLayout(0, acc_l))
        vec = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, w3)))
        r3 = gl.expand_dims(gl.expand_dims(rows, 1), 2)
        s3 = gl.expand_dims(gl.expand_dims(subs, 0), 2)
        v3 = gl.expand_dims(gl.expand_dims(vec, 0), 1)
        w_tile = w_ptr + r3.to(gl.int64) * K + s3 * 8 + v3  # [BLOCK_N, SUB, 8]
        x_offs = (gl.expand_dims(gl.arange(0, SUB, layout=gl.SliceLayout(1, x_l)), 1) * 8
                  + gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, x_l)), 0))  # [SUB, 8]
        parked = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [PRE, BLOCK_N, SUB, 8], flat)
        q0, q1, q2, q3 = _park(parked, w_tile, PRE, STAGE_K, NUM_K, 0)
        if PDL:
            _gdc_wait()  # x is the previous kernel's output
        x0 = gl.load(x_ptr + x_offs)
        x1 = x0  # rows past M: placeholders, never read (_dot_rows skips them)
        x2 = x0
        x3 = x0
        if M > 1:
            x1 = gl.load(x_ptr + stride_xm + x_offs)
        if M > 2:
            x2 = gl.load(x_ptr + 2 * stride_xm + x_offs)
        if M > 3:
            x3 = gl.load(x_ptr + 3 * stride_xm + x_offs)
        acc0 = gl.zeros([BLOCK_N, SUB], gl.float32, acc_l)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        for i in gl.static_range(NUM_K):
            c0 = x0
            c1 = x1
            c2 = x2
            c3 = x3
            x0 = _x_stage(x_ptr, 0, stride_xm, i + 1, x_offs, STAGE_K, NUM_K, c0)
            if M > 1:
                x1 = _x_stage(x_ptr, 1, stride_xm, i + 1, x_offs, STAGE_K, NUM_K, c1)
            if M > 2:
                x2 = _x_stage(x_ptr, 2, stride_xm, i + 1, x_offs, STAGE_K, NUM_K, c2)
            if M > 3:
                x3 = _x_stage(x_ptr, 3, stride_xm, i + 1, x_offs, STAGE_K, NUM_K, c3)
            if i < PRE:
                wf = parked.index(i).load(w3).to(gl.float32)
            else:
                w, q0, q1, q2, q3 = _next_stage(q0, q1, q2, q3, w_tile, i, STAGE_K, NUM_K)
                wf = w.to(gl.float32)
            acc0, acc1, acc2, acc3 = _dot_rows(wf, c0, c1, c2, c3, acc0, acc1, acc2, acc3, M)
        if PDL:
            _gdc_launch_dependents()  # the weights are read
        _store_row(y_ptr, 0, stride_ym, rows, acc0)
        if M > 1:
            _store_row(y_ptr, 1, stride_ym, rows, acc1)
        if M > 2:
            _store_row(y_ptr, 2, stride_ym, rows, acc2)
        if M > 3:
            _store_row(y_ptr, 3, stride_ym, rows, acc3)

    @gluon.jit
    def _staged_mma_kernel(
        w_ptr, x_ptr, y_ptr, stride_xm, stride_ym, K: gl.constexpr, M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGE_K: gl.constexpr, STAGES: gl.constexpr, NUM_K: gl.constexpr,
        PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        # 1-4 rows on the tensor cores. A stage is [num_warps, BLOCK_N = 16, STAGE_K]: warp w
        # holds the K slice w of it (columns i SUPER + w STAGE_K ..), parked or in flight as in
        # the other kernels, and after the wait multiplies it by x^T [STAGE_K, 8] (rows of x past
        # M read as zeros) with mma.sync m16n8k16 into its own acc [16, 8] fp32 (a batched
        # dot, the warps the batch); the warps' accumulators are summed once at the end
        PRE: gl.constexpr = STAGES if STAGES < NUM_K else NUM_K
        SUPER: gl.constexpr = num_warps * STAGE_K
        w3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [num_warps, 1, 1], [2, 1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1, 1],
                                                      instr_shape=[1, 16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # 16-byte chunks XOR-swizzled over 8 phases: ldmatrix reads the rows without bank conflicts
        swizzled: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
        n0 = gl.program_id(0) * BLOCK_N
        wi = gl.arange(0, num_warps, layout=gl.SliceLayout(1, gl.SliceLayout(2, w3)))
        ri = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, w3)))
        ci = gl.arange(0, STAGE_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, w3)))
        w_tile = (w_ptr + (n0 + ri)[None, :, None].to(gl.int64) * K + wi[:, None, None] * STAGE_K
                  + ci[None, None, :])  # [num_warps, BLOCK_N, STAGE_K]
        parked = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [PRE * num_warps, BLOCK_N, STAGE_K], swizzled)
        q0, q1, q2, q3 = _park(parked, w_tile, PRE, SUPER, NUM_K, num_warps)
        if PDL:
            _gdc_wait()  # x is the previous kernel's output
        # x^T slices [num_warps, STAGE_K, 8]: element (w, k, m) = x[m, w STAGE_K + k] (0 past M)
        bw = gl.arange(0, num_warps, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_l)))
        bk = gl.arange(0, STAGE_K, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_l)))
        bm = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_l)))
        x_t = x_ptr + bm[None, None, :] * stride_xm + bw[:, None, None] * STAGE_K + bk[None, :, None]
        x_ok = (bm[None, None, :] < M) & (bk[None, :, None] < STAGE_K) & (bw[:, None, None] < num_warps)
        acc = gl.zeros([num_warps, BLOCK_N, 8], gl.float32, mma)
        gl.thread_barrier()  # the parked stages are read in the mma operand layout, not as written
        for i in gl.static_range(NUM_K):
            xs = gl.load(x_t + i * SUPER, mask=x_ok, other=0.0)
            if i < PRE:
                a = parked.slice(i * num_warps, num_warps).load(a_l)
            else:
                w, q0, q1, q2, q3 = _next_stage(q0, q1, q2, q3, w_tile, i, SUPER, NUM_K)
                a = gl.convert_layout(w, a_l)
            acc = mma_v2(a, xs, acc)
        if PDL:
            _gdc_launch_dependents()  # the weights are read
        out = gl.sum(acc, axis=0)  # [BLOCK_N, 8]: the warps' K slices, in a fixed order
        o_l: gl.constexpr = gl.SliceLayout(0, mma)
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, o_l))
        cols = gl.arange(0, 8, layout=gl.SliceLayout(0, o_l))
        gl.store(y_ptr + cols[None, :] * stride_ym + rows[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=cols[None, :] < M)

    return _staged_gemv_kernel, _staged_rows_kernel, _staged_mma_kernel


def staged_gemv(x: torch.Tensor, weight: torch.Tensor, config: StagedConfig | None = None) -> torch.Tensor:
    """``x @ weight^T`` for 1-4 rows, the weight parked in shared memory before the PDL wait
    (module docstring).

    Args:
        x: ``[M, K]``, ``M <= 4``, bf16 / fp16 on a CUDA sm_90+ device, unit column stride.
        weight: ``[N, K]`` of x's dtype, contiguous.
        config: tiles; ``None``: :func:`default_config` ``(N, K, M)``.

    Returns:
        ``[M, N]`` in x.dtype: ``F.linear(x, weight)`` up to the fp32 summation order (within one
        output ulp of the exact sum); bitwise reproducible for a config.
    """
    n, k = weight.shape
    m = x.shape[0] if x.dim() == 2 else 0
    cfg = config or default_config(n, k, m)
    if not can_use(x, weight, cfg):
        raise ValueError(f"staged_gemv cannot run x {tuple(x.shape)} {x.dtype} @ weight {tuple(weight.shape)} "
                         f"{weight.dtype} with {cfg}; check can_use() first and fall back to F.linear")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kernel, grid, args, kwargs = _launch_arguments(x, weight, cfg, y)
    kernel[grid](*args, **kwargs)
    return y


def _launch_arguments(x: torch.Tensor, weight: torch.Tensor, cfg: StagedConfig, y: torch.Tensor):
    """``(kernel, grid, args, kwargs)`` of :func:`staged_gemv`'s launch writing ``y [M, N]``
    (the CPU tests run the same call through tests/gluon_emulator.py)."""
    (n, k), m = weight.shape, x.shape[0]
    use_pdl = pdl.active(x.device, False)
    num_k = k // cfg.stage_cols
    one_row, rows, mma = _kernel()
    consts = dict(K=k, M=m, BLOCK_N=cfg.block_n, STAGE_K=cfg.stage_k, STAGES=cfg.parked(k), NUM_K=num_k,
                  PDL=use_pdl, num_warps=cfg.num_warps)
    if cfg.tensor_cores:
        kernel = mma
    elif m == 1:
        kernel, consts["X_ROWS"] = one_row, _next_pow2(num_k)
    else:
        kernel = rows
    return kernel, (n // cfg.block_n,), (weight, x, y, x.stride(0), n), {**consts, **pdl.launch_options(use_pdl)}
