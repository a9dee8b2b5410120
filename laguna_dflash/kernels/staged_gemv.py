"""GEMV ``y = x @ W^T`` for one row that parks its weight in shared memory before the PDL wait.

For ``x [1, K]`` and ``W [N, K]`` (bf16 / fp16)::

    y[0, n] = sum_k x[0, k] * W[n, k]          fp32 accumulation, y rounded once to x.dtype

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
stages. x goes through shared memory once (one barrier); one accumulator ``[BLOCK_N, STAGE_K]``
fp32 in the weight tile's layout (one FMA per weight element); the K reduction once, at the end.

One row only: the K = 3 verify's and the drafter block's o_proj (2-4 rows) take the skinny GEMM.
Two 2-4 row kernels (on CUDA cores: x read from global memory, 1/8 accumulators; on the tensor
cores: ``mma.sync m16n8k16``) both lost in the H200's CUDA graphs: the 4-token verify graph
3.79-3.81 ms with the tensor-core kernel and 4.52-4.55 with the CUDA-core one, against 3.68 with
the skinny GEMM; the drafter block 0.35-0.46 against 0.33 ms (docs/PERFORMANCE.md, sixty-sixth
pass). An earlier 2-4 row design (x in shared memory, full accumulators) lost in the fourteenth
and sixty-third passes. Commit 5d91d44 is the last tree with the 2-4 row kernels; they were
timed only at configs parking 16.8 MB a launch, and ``benchmarks/gpu_check.sh pass109`` times
the tensor-core one at 4.2-8.4 MB from that tree (docs/PERFORMANCE.md, sixty-eighth pass).

The grid and every launch argument depend only on the shapes and the config: CUDA-graph
capturable, no host sync. The kernel sums in fp32 and rounds y once; it is bitwise reproducible
for a config.

Written in Gluon (triton.experimental.gluon, pinned with triton 3.6), which exposes shared
memory; it has no interpreter: CPU tests check the sm_90 build offline and the values of the
kernel's Python body run on torch tensors (tests/gluon_emulator.py: the index arithmetic,
masks, staging and stores, not the compiler or races), GPU tests the values against an fp64
reference (tests/test_kernel_staged_gemv.py). Other ways of filling the stages
(TMA boxes, ``cp.async``) measured slower in the decode graph (docs/PERFORMANCE.md, thirteenth
pass; their branch was not kept).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import pdl

__all__ = ["StagedConfig", "can_use", "default_config", "staged_gemv", "staged_gemv_reference", "supports"]

_DTYPES = (torch.bfloat16, torch.float16)
_MAX_SMEM = 220 * 1024  # of the 227 KiB a program may have on sm_90


@dataclass(frozen=True)
class StagedConfig:
    """Launch configuration of :func:`staged_gemv`.

    Attributes:
        block_n: weight rows per program (a power of two in [8, 64]).
        stage_k: K elements of one stage (a power of two, >= 64; 16-byte loads a thread).
        stages: stages parked in shared memory before the PDL wait.
        num_warps: warps per program.
    """

    block_n: int = 8
    stage_k: int = 512
    stages: int = 8
    num_warps: int = 4

    def parked(self, k: int) -> int:
        """Stages parked before the wait for a K of ``k`` columns."""
        return min(self.stages, -(-k // self.stage_k))

    def smem_bytes(self, k: int, elem_bytes: int = 2) -> int:
        """Shared memory a program needs: the parked stages plus x (as ``K / stage_k`` rows of a
        stage, padded to a power of two)."""
        num_k = -(-k // self.stage_k)
        return (self.parked(k) * self.block_n + _next_pow2(num_k)) * self.stage_k * elem_bytes


# (block_n, stage_k, stages, num_warps) of the decode's o_proj: 8 x 512 stages, 8 parked (64 KiB),
# 4 warps: two programs an SM next to attention (thirteenth pass, docs/PERFORMANCE.md). 10 and
# 12 parked stages made the decode replay 0.03-0.04 ms slower (nineteenth pass): they crowd out
# attention and the merge.
ONE_ROW_CONFIG: tuple[int, int, int, int] = (8, 512, 8, 4)


def default_config(n: int, k: int) -> StagedConfig:
    """The measured o_proj config (2048 x 8192 and 2048 x 6144 on the H200: 8 x 512 stages, 8
    parked, 4 warps), the stage narrowed to divide smaller K (down to 64)."""
    del n
    cfg = StagedConfig(*ONE_ROW_CONFIG)
    while cfg.stage_k > 64 and k % cfg.stage_k:
        cfg = dataclasses.replace(cfg, stage_k=cfg.stage_k // 2)
    return cfg


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


@functools.cache
def _has_gluon() -> bool:
    """triton's Gluon dialect with what the kernel uses (triton 3.6 has it; older ones do not)."""
    try:
        from triton.experimental.gluon import language as gl
    except ImportError:
        return False
    return all(hasattr(gl, a) for a in ("allocate_shared_memory", "SwizzledSharedLayout", "BlockedLayout"))


def supports(weight: torch.Tensor, config: StagedConfig | None = None, m: int = 1) -> bool:
    """Whether :func:`staged_gemv` runs with ``weight [N, K]`` and an x of ``m`` rows (of its
    dtype, on its device): CUDA sm_90+ with triton's Gluon, bf16 / fp16, contiguous and 16-byte
    aligned, ``m == 1`` (one-row kernel only: module docstring), N a multiple of ``block_n``, K
    of ``stage_k``, the parked stages and x within a program's shared memory."""
    if m != 1:
        return False
    if not weight.is_cuda or weight.dim() != 2 or weight.dtype not in _DTYPES or not _has_gluon():
        return False
    if torch.cuda.get_device_capability(weight.device) < (9, 0):
        return False
    n, k = weight.shape
    cfg = config or default_config(n, k)
    return (weight.is_contiguous() and weight.data_ptr() % 16 == 0 and n > 0 and k > 0
            and n % cfg.block_n == 0 and k % cfg.stage_k == 0 and cfg.smem_bytes(k) <= _MAX_SMEM)


def can_use(x: torch.Tensor, weight: torch.Tensor, config: StagedConfig | None = None) -> bool:
    """:func:`supports` ``weight`` for x's rows (one), and x is ``[1, K]`` of its dtype and device
    with unit column stride."""
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
    def _park(parked, w_tile, PRE: gl.constexpr, STAGE: gl.constexpr, NUM_K: gl.constexpr):
        # stages 0 .. PRE - 1 into the parked buffer (entry i), stages PRE .. PRE + 3 left in
        # flight (returned). The weight is never written in a forward (kernels/pdl.py rule 3):
        # this runs before the PDL wait
        q0 = gl.load(w_tile, eviction_policy="evict_first")
        q1 = _stage_load(w_tile, 1, STAGE, NUM_K, q0)
        q2 = _stage_load(w_tile, 2, STAGE, NUM_K, q0)
        q3 = _stage_load(w_tile, 3, STAGE, NUM_K, q0)
        for i in gl.static_range(PRE):
            w, q0, q1, q2, q3 = _next_stage(q0, q1, q2, q3, w_tile, i, STAGE, NUM_K)
            parked.index(i).store(w)
        return q0, q1, q2, q3

    @gluon.jit
    def _x_to_shared(x_ptr, xr, cols, STAGE_K: gl.constexpr, NUM_K: gl.constexpr,
                     X_ROWS: gl.constexpr, flat: gl.constexpr):
        # x [K] -> shared [X_ROWS, STAGE_K] (NUM_K rows of a stage each, padded)
        xv = gl.load(x_ptr + xr[:, None] * STAGE_K + cols[None, :],
                     mask=xr[:, None] < NUM_K, other=0.0)
        return gl.allocate_shared_memory(xv.dtype, [X_ROWS, STAGE_K], flat, xv)

    @gluon.jit
    def _store_row(y_ptr, rows, acc):
        out = gl.sum(acc, axis=1)  # [BLOCK_N] of y
        gl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty))

    @gluon.jit
    def _staged_gemv_kernel(
        w_ptr, x_ptr, y_ptr, K: gl.constexpr, BLOCK_N: gl.constexpr, STAGE_K: gl.constexpr,
        STAGES: gl.constexpr, NUM_K: gl.constexpr, X_ROWS: gl.constexpr, PDL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # x [K] (one row): stages 0 .. PRE - 1 parked in shared memory before the wait, the
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
        q0, q1, q2, q3 = _park(parked, w_tile, PRE, STAGE_K, NUM_K)
        if PDL:
            _gdc_wait()  # x is the previous kernel's output
        xr = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, w_layout))
        x0 = _x_to_shared(x_ptr, xr, cols, STAGE_K, NUM_K, X_ROWS, flat)
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
        _store_row(y_ptr, rows, acc0)

    return _staged_gemv_kernel


def staged_gemv(x: torch.Tensor, weight: torch.Tensor, config: StagedConfig | None = None) -> torch.Tensor:
    """``x @ weight^T`` for one row, the weight parked in shared memory before the PDL wait
    (module docstring).

    Args:
        x: ``[1, K]`` bf16 / fp16 on a CUDA sm_90+ device, unit column stride.
        weight: ``[N, K]`` of x's dtype, contiguous.
        config: tiles; ``None``: :func:`default_config` ``(N, K)``.

    Returns:
        ``[1, N]`` in x.dtype: ``F.linear(x, weight)`` up to the fp32 summation order (within one
        output ulp of the exact sum); bitwise reproducible for a config.

    Raises:
        ValueError: where :func:`can_use` is False (more rows than one among the reasons).
    """
    n, k = weight.shape
    cfg = config or default_config(n, k)
    if not can_use(x, weight, cfg):
        raise ValueError(f"staged_gemv cannot run x {tuple(x.shape)} {x.dtype} @ weight {tuple(weight.shape)} "
                         f"{weight.dtype} with {cfg} (it takes x [1, K]); check can_use() first and fall back to "
                         "F.linear")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    kernel, grid, args, kwargs = _launch_arguments(x, weight, cfg, y)
    kernel[grid](*args, **kwargs)
    return y


def _launch_arguments(x: torch.Tensor, weight: torch.Tensor, cfg: StagedConfig, y: torch.Tensor):
    """``(kernel, grid, args, kwargs)`` of :func:`staged_gemv`'s launch writing ``y [1, N]``
    from ``x [1, K]`` (the CPU tests run the same call through tests/gluon_emulator.py)."""
    n, k = weight.shape
    use_pdl = pdl.active(x.device, False)
    num_k = k // cfg.stage_k
    consts = dict(K=k, BLOCK_N=cfg.block_n, STAGE_K=cfg.stage_k, STAGES=cfg.parked(k), NUM_K=num_k,
                  X_ROWS=_next_pow2(num_k), PDL=use_pdl, num_warps=cfg.num_warps)
    return _kernel(), (n // cfg.block_n,), (weight, x, y), {**consts, **pdl.launch_options(use_pdl)}
