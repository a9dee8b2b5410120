"""Batch-1 GEMV ``y = x @ W^T`` whose weight is staged in shared memory before the PDL wait.

For ``x [1, K]`` and ``W [N, K]`` (bf16 / fp16)::

    y[n] = sum_k x[k] * W[n, k]          fp32 accumulation, y rounded once to x.dtype

Why (docs/PERFORMANCE.md, thirteenth pass): between the batch-1 decode step's weight streams sit
latency-bound kernels (Q/K norm + RoPE, attention, the split merge) during which the HBM idles.
With programmatic dependent launch a kernel's programs can be resident while the kernel before
it runs, but the skinny GEMM (kernels/skinny_gemm.py) can only hold one register tile a program
before its wait. Here every program issues TMA copies of its first ``STAGES`` weight stages into
shared memory (up to ~200 KiB an SM, no registers held) *before* ``griddepcontrol.wait``; after
the wait it loads x, consumes the stages as they land and refills each freed stage with the next
one (a TMA ring, one mbarrier a stage).

Grid ``ceil(N / BLOCK_N)``: program ``j`` owns rows ``[j BLOCK_N, (j + 1) BLOCK_N)`` over all of
K (no split-K, so no workspace and no second pass). A stage is ``BOXES`` TMA boxes of
``[BLOCK_N, BOX_K]``; the K loop walks ``NUM_STAGES_K = K / (BOXES BOX_K)`` stages. x is loaded
once after the wait into shared memory (``[K / BOX_K, BOX_K]``) so the loop reads it
with no global round trip. The accumulator ``[BLOCK_N, BOX_K]`` fp32 lives in the box's
register layout (one FMA per weight element); the K reduction happens once, at the end.

Written in Gluon (triton.experimental.gluon), which exposes shared memory, TMA and mbarriers;
it compiles for sm_90 only (no interpreter): CPU tests check the sm_90 build offline, GPU tests
check values against ``F.linear`` (see tests/test_kernel_staged_gemv.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import pdl

__all__ = ["StagedConfig", "can_use", "default_config", "staged_gemv", "staged_gemv_reference"]

_DTYPES = (torch.bfloat16, torch.float16)
_MAX_SMEM = 220 * 1024  # of the 227 KiB a program may have on sm_90 (barriers, x's padding)


@dataclass(frozen=True)
class StagedConfig:
    """Launch configuration of :func:`staged_gemv`.

    Attributes:
        block_n: weight rows per program (a power of two in [8, 64]).
        box_k: K elements of one TMA box (a power of two in [64, 256]).
        boxes: boxes per stage (one mbarrier a stage).
        stages: stages in the shared-memory ring, all issued before the PDL wait.
        num_warps: warps per program.
        mode: how the stages reach shared memory. ``"tma"``: TMA boxes, one mbarrier a stage
            (the L2's default eviction priority). ``"cp_async"``: per-thread ``cp.async`` of 16
            bytes, one commit group a stage (triton 3.6 drops the eviction hint here, so also
            the default priority). ``"ld_st"``: ``evict_first`` loads into registers (four
            stages in flight) stored to shared memory, before the wait, for the first
            ``stages`` stages; the others stream through registers after it. Each thread reads
            back exactly the bytes it copied.
    """

    block_n: int = 8
    box_k: int = 256
    boxes: int = 4
    stages: int = 4
    num_warps: int = 4
    mode: str = "tma"

    def smem_bytes(self, k: int, elem_bytes: int = 2) -> int:
        """Shared memory a program needs: the ring plus x (padded to a power of two of boxes)."""
        x_rows = 1 << max(0, -(-k // self.box_k) - 1).bit_length()
        if self.mode != "tma":  # x as [K / stage (padded to a power of two), stage]
            stage_k = self.boxes * self.box_k
            x_rows = 1 << max(0, -(-k // stage_k) - 1).bit_length()
            return (self.stages * self.block_n + x_rows) * stage_k * elem_bytes
        return (self.stages * self.boxes * self.block_n * self.box_k + x_rows * self.box_k) * elem_bytes


DEFAULT_STAGES = 4  # stages of the ring (A/B knobs for benchmarks/profile_decode_xs.py --switch)
DEFAULT_MODE = "tma"
DEFAULT_BOXES = 4


def default_config(n: int, k: int) -> StagedConfig:
    """The config for ``W [n, k]``: the measured o_proj one (2048 x 8192 on the H200), with the box
    and stage narrowed to divide smaller K (``box_k`` down to 64, ``boxes`` down to 1)."""
    del n
    box_k, boxes = 256, DEFAULT_BOXES
    while box_k > 64 and k % box_k:
        box_k //= 2
    while boxes > 1 and k % (boxes * box_k):
        boxes //= 2
    return StagedConfig(box_k=box_k, boxes=boxes, stages=DEFAULT_STAGES, mode=DEFAULT_MODE)


def can_use(x: torch.Tensor, weight: torch.Tensor, config: StagedConfig | None = None) -> bool:
    """Whether :func:`staged_gemv` runs ``(x, weight)``: CUDA sm_90+, one row, bf16 / fp16,
    contiguous 16-byte-aligned weight, K a multiple of a stage, N of ``block_n``, the ring and x
    within a program's shared memory."""
    if not (x.is_cuda and weight.is_cuda and x.dim() == 2 and weight.dim() == 2):
        return False
    if x.shape[0] != 1 or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    n, k = weight.shape
    cfg = config or default_config(n, k)
    return (x.shape[1] == k and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and n % cfg.block_n == 0 and k % (cfg.boxes * cfg.box_k) == 0 and k > 0
            and cfg.smem_bytes(k) <= _MAX_SMEM and x.stride(1) == 1)


def staged_gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``: ``[1, K] @ [N, K]^T -> [1, N]``."""
    return F.linear(x, weight)


@functools.cache
def _gluon():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _issue(w_desc, ring, bars, stage, n0, k0, BOX_K: gl.constexpr, BOXES: gl.constexpr,
               STAGE_BYTES: gl.constexpr):
        # stage `stage` <- W[n0 : n0 + BLOCK_N, k0 : k0 + BOXES BOX_K], BOXES TMA copies, one barrier
        bar = bars.index(stage)
        mbarrier.expect(bar, STAGE_BYTES)
        for b in gl.static_range(BOXES):
            tma.async_copy_global_to_shared(w_desc, [n0, k0 + b * BOX_K], bar, ring.index(stage * BOXES + b))

    @gluon.jit
    def _staged_gemv_kernel(
        w_desc, x_ptr, y_ptr,
        BLOCK_N: gl.constexpr, BOX_K: gl.constexpr, BOXES: gl.constexpr, STAGES: gl.constexpr,
        NUM_K: gl.constexpr, X_ROWS: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        STAGE_K: gl.constexpr = BOXES * BOX_K
        STAGE_BYTES: gl.constexpr = BLOCK_N * STAGE_K * 2
        PRE: gl.constexpr = STAGES if STAGES < NUM_K else NUM_K
        n0 = gl.program_id(0) * BLOCK_N

        ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES * BOXES, BLOCK_N, BOX_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        # the weight is never written in a forward (kernels/pdl.py rule 3): its first stages are
        # requested before the wait, while the kernels before this one still run
        for s in gl.static_range(PRE):
            _issue(w_desc, ring, bars, s, n0, s * STAGE_K, BOX_K, BOXES, STAGE_BYTES)
        if PDL:
            _gdc_wait()  # x is the previous kernel's output

        # x [K] -> shared [X_ROWS, BOX_K] (K / BOX_K rows, padded to a power of two), read a box
        # at a time in the box's column layout
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, num_warps], [1, 0])
        xr = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, x_layout))
        xc = gl.arange(0, BOX_K, layout=gl.SliceLayout(0, x_layout))
        xv = gl.load(x_ptr + xr[:, None] * BOX_K + xc[None, :], mask=xr[:, None] < NUM_K * BOXES, other=0.0)
        x_smem = gl.allocate_shared_memory(xv.dtype, [X_ROWS, BOX_K],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]), xv)

        w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        acc = gl.zeros([BLOCK_N, BOX_K], gl.float32, w_layout)
        gl.thread_barrier()  # x_smem written by every thread
        for i in gl.static_range(NUM_K):  # unrolled: the slots, phases and x rows are constants
            slot = i % STAGES
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            for b in gl.static_range(BOXES):
                w = ring.index(slot * BOXES + b).load(w_layout).to(gl.float32)
                xb = x_smem.slice(i * BOXES + b, 1).load(w_layout).to(gl.float32)  # [1, BOX_K]
                acc += w * xb
            gl.thread_barrier()  # every thread has read the slot before it is refilled
            if i + STAGES < NUM_K:
                _issue(w_desc, ring, bars, slot, n0, (i + STAGES) * STAGE_K, BOX_K, BOXES, STAGE_BYTES)
        if PDL:
            _gdc_launch_dependents()  # the weights are read
        out = gl.sum(acc, axis=1)  # [BLOCK_N]
        offs = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
        gl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty))

    @gluon.jit
    def _staged_gemv_cp_kernel(
        w_ptr, x_ptr, y_ptr, K: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGE_K: gl.constexpr, STAGES: gl.constexpr, NUM_K: gl.constexpr,
        X_ROWS: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        # the cp_async variant (StagedConfig.mode): the same ring, one commit group a stage
        PRE: gl.constexpr = STAGES if STAGES < NUM_K else NUM_K
        n0 = gl.program_id(0) * BLOCK_N
        w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
        cols = gl.arange(0, STAGE_K, layout=gl.SliceLayout(0, w_layout))
        w_tile = w_ptr + rows[:, None].to(gl.int64) * K + cols[None, :]
        ring = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STAGES, BLOCK_N, STAGE_K], flat)
        # the weight is never written in a forward (kernels/pdl.py rule 3): stages before the wait
        for s in gl.static_range(PRE):
            async_copy.async_copy_global_to_shared(ring.index(s), w_tile + s * STAGE_K,
                                                   eviction_policy="evict_first")
            async_copy.commit_group()
        if PDL:
            _gdc_wait()  # x is the previous kernel's output
        xr = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, w_layout))  # NUM_K rows, padded
        xv = gl.load(x_ptr + xr[:, None] * STAGE_K + cols[None, :], mask=xr[:, None] < NUM_K, other=0.0)
        x_smem = gl.allocate_shared_memory(xv.dtype, [X_ROWS, STAGE_K], flat, xv)
        gl.thread_barrier()  # x_smem written by every thread
        acc = gl.zeros([BLOCK_N, STAGE_K], gl.float32, w_layout)
        for i in gl.static_range(NUM_K):
            # stages issued so far: 0 .. min(NUM_K, STAGES + i) - 1; stage i must have landed
            async_copy.wait_group((STAGES + i if STAGES + i < NUM_K else NUM_K) - 1 - i)
            w = ring.index(i % STAGES).load(w_layout).to(gl.float32)
            acc += w * x_smem.slice(i, 1).load(w_layout).to(gl.float32)
            if i + STAGES < NUM_K:  # refill the slot this thread just read (its own bytes)
                async_copy.async_copy_global_to_shared(ring.index(i % STAGES), w_tile + (i + STAGES) * STAGE_K,
                                                       eviction_policy="evict_first")
                async_copy.commit_group()
        if PDL:
            _gdc_launch_dependents()  # the weights are read
        out = gl.sum(acc, axis=1)  # [BLOCK_N]
        gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty))

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
    def _staged_gemv_ldst_kernel(
        w_ptr, x_ptr, y_ptr, K: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGE_K: gl.constexpr, STAGES: gl.constexpr, NUM_K: gl.constexpr,
        X_ROWS: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):
        # the ld_st variant (StagedConfig.mode): stages 0 .. PRE - 1 parked in shared memory
        # before the wait, the rest consumed from registers after it; q0..q3 always hold the
        # next four stages' loads (in flight)
        PRE: gl.constexpr = STAGES if STAGES < NUM_K else NUM_K
        n0 = gl.program_id(0) * BLOCK_N
        w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
        cols = gl.arange(0, STAGE_K, layout=gl.SliceLayout(0, w_layout))
        w_tile = w_ptr + rows[:, None].to(gl.int64) * K + cols[None, :]
        ring = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [PRE, BLOCK_N, STAGE_K], flat)
        q0 = gl.load(w_tile, eviction_policy="evict_first")
        q1 = _stage_load(w_tile, 1, STAGE_K, NUM_K, q0)
        q2 = _stage_load(w_tile, 2, STAGE_K, NUM_K, q0)
        q3 = _stage_load(w_tile, 3, STAGE_K, NUM_K, q0)
        # the weight is never written in a forward (kernels/pdl.py rule 3): parked before the wait
        for i in gl.static_range(PRE):
            w = q0
            q0 = q1
            q1 = q2
            q2 = q3
            q3 = _stage_load(w_tile, i + 4, STAGE_K, NUM_K, w)
            ring.index(i).store(w)
        if PDL:
            _gdc_wait()  # x is the previous kernel's output
        xr = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, w_layout))  # NUM_K rows, padded
        xv = gl.load(x_ptr + xr[:, None] * STAGE_K + cols[None, :], mask=xr[:, None] < NUM_K, other=0.0)
        x_smem = gl.allocate_shared_memory(xv.dtype, [X_ROWS, STAGE_K], flat, xv)
        gl.thread_barrier()  # x_smem written by every thread
        acc = gl.zeros([BLOCK_N, STAGE_K], gl.float32, w_layout)
        for i in gl.static_range(PRE):
            acc += ring.index(i).load(w_layout).to(gl.float32) * x_smem.slice(i, 1).load(w_layout).to(gl.float32)
        for i in gl.static_range(PRE, NUM_K):
            w = q0
            q0 = q1
            q1 = q2
            q2 = q3
            q3 = _stage_load(w_tile, i + 4, STAGE_K, NUM_K, w)
            acc += w.to(gl.float32) * x_smem.slice(i, 1).load(w_layout).to(gl.float32)
        if PDL:
            _gdc_launch_dependents()  # the weights are read
        out = gl.sum(acc, axis=1)  # [BLOCK_N]
        gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty))

    return _staged_gemv_kernel, _staged_gemv_cp_kernel, _staged_gemv_ldst_kernel


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


_DESCRIPTORS: dict[tuple, object] = {}


def _descriptor(weight: torch.Tensor, cfg: StagedConfig):
    """The TMA descriptor of ``weight`` with ``[block_n, box_k]`` boxes (cached: weights are
    static, and a captured graph keeps the descriptor it was launched with)."""
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, cfg.block_n, cfg.box_k)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        desc = _DESCRIPTORS[key] = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.box_k], layout)
    return desc


def staged_gemv(x: torch.Tensor, weight: torch.Tensor, config: StagedConfig | None = None) -> torch.Tensor:
    """``x @ weight^T`` for one row, the weight staged through shared memory (module docstring).

    Args:
        x: ``[1, K]`` bf16 / fp16 on a CUDA sm_90+ device, unit column stride.
        weight: ``[N, K]`` of x's dtype, contiguous.
        config: tiles; ``None``: :func:`default_config`.

    Returns:
        ``[1, N]`` in x.dtype: ``F.linear(x, weight)`` up to the fp32 summation order.
    """
    n, k = weight.shape
    cfg = config or default_config(n, k)
    if not can_use(x, weight, cfg):
        raise ValueError(f"staged_gemv cannot run x {tuple(x.shape)} {x.dtype} @ weight {tuple(weight.shape)} "
                         f"{weight.dtype} with {cfg}; check can_use() first and fall back to F.linear")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    use_pdl = pdl.active(x.device, False)
    tma_kernel, cp_kernel, ldst_kernel = _gluon()
    if cfg.mode != "tma":
        stage_k = cfg.boxes * cfg.box_k
        (cp_kernel if cfg.mode == "cp_async" else ldst_kernel)[(n // cfg.block_n,)](
            weight, x, y, K=k, BLOCK_N=cfg.block_n, STAGE_K=stage_k, STAGES=cfg.stages,
            NUM_K=k // stage_k, X_ROWS=_next_pow2(k // stage_k), PDL=use_pdl, num_warps=cfg.num_warps,
            **pdl.launch_options(use_pdl))
        return y
    tma_kernel[(n // cfg.block_n,)](
        _descriptor(weight, cfg), x, y,
        BLOCK_N=cfg.block_n, BOX_K=cfg.box_k, BOXES=cfg.boxes, STAGES=cfg.stages,
        NUM_K=k // (cfg.boxes * cfg.box_k), X_ROWS=_next_pow2(k // cfg.box_k), PDL=use_pdl,
        num_warps=cfg.num_warps,
        **pdl.launch_options(use_pdl),
    )
    return y
