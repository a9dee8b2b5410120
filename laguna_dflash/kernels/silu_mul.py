"""SwiGLU activation ``silu(gate) * up`` in ONE Triton launch, programmatic-dependent-launch capable.

A dense MLP (the drafter's five layers, the target's first layer) runs its gate|up GEMM, this
activation and its down GEMM. The GEMMs take part in PDL (kernels/pdl.py); a torch.compile'd
activation is a normal launch between them, which drains the pipeline twice per MLP: it starts
only once every gate|up program has exited, and the down GEMM's programs can load no weight
while it runs. This kernel computes the same values and takes part in PDL. Where the gate|up
runs through the skinny GEMM (CUDA graphs, tuned shapes) its epilogue computes these values
instead (``skinny_gemm(..., glu=True)``, bitwise this kernel's result; ``layers.gate_up_silu``).
Per row ``t`` of ``gate_up [T, 2I]`` (gate half first) in dtype ``T``::

    s = T(g / (1 + exp(-g)))        g = gate_up[t, :I], in fp32 (torch's silu in its opmath)
    y = T(s * u)                    u = gate_up[t, I:], the product in fp32, rounded once

which is ``F.silu(gate) * up`` evaluated eagerly: on CUDA ``exp`` is libdevice's ``expf``, the
one torch's silu kernel calls, the division is correctly rounded and nothing is FMA-contracted
(under the interpreter ``exp`` is numpy's, which may differ from torch's CPU one in the last
fp32 bit).

Grid ``(T, cdiv(I, BLOCK))``: each program a ``BLOCK``-wide slice of one row. The launch depends
only on shapes and nothing is read back on the host: CUDA-graph capturable. Under PDL a program
reads nothing before its wait (both operands are the previous GEMM's output) and signals its
dependents right after it, so the down GEMM's programs load their first weight tiles while this
kernel runs.
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

__all__ = ["BLOCK", "can_run", "is_available", "silu_mul"]

# Columns of one row a program handles (4 warps: 8 gate and 8 up values a thread). At decode
# sizes (T = 1..16, I = 8192) that is 8..128 programs: short, latency-bound programs.
BLOCK = 1024


def is_available(device: torch.device | str) -> bool:
    """Triton importable and a CUDA device of compute capability >= 8.0, or a CPU under
    ``TRITON_INTERPRET=1``."""
    return triton_can_run(device, min_major=8)


def _silu_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, INTER: tl.constexpr, BLOCK: tl.constexpr,
                     DTYPE: tl.constexpr, PDL: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    if PDL:  # kernels/pdl.py: wait for the GEMM writing gate|up, then let the down GEMM launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = x_ptr + t * stride_xt
    g = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(row + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:  # CUDA's expf, as torch's silu kernel calls it (tl.exp is ex2.approx)
        e = tl.extra.cuda.libdevice.exp(-g)
    else:  # the interpreter has no libdevice: numpy's exp
        e = tl.exp(-g)
    s = _round_to(tl.math.div_rn(g, 1.0 + e), DTYPE)
    tl.store(out_ptr + t * stride_ot + cols, _round_to(s * u, DTYPE), mask=ok)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key; triton reads the environment)."""
    del interpret
    return jit_functions(__name__, (_round_to, _silu_mul_kernel))["_silu_mul_kernel"]


def _operand_problem(gate_up: torch.Tensor) -> str | None:
    """What about ``gate_up`` the kernel cannot take; None if nothing."""
    if gate_up.dim() != 2 or gate_up.dtype not in DTYPE_CODE:
        return (f"gate_up must be [T, 2I] float32 / bfloat16 / float16, got "
                f"{tuple(gate_up.shape)} {gate_up.dtype}")
    if gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        return f"gate_up must have an even width and unit stride along it, got {tuple(gate_up.shape)}"
    return None


def can_run(gate_up: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` takes ``gate_up`` here (else the caller runs its reference):
    ``[T, 2I]`` fp32 / bf16 / fp16 with unit stride along the width, and :func:`is_available`
    on its device."""
    return _operand_problem(gate_up) is None and is_available(gate_up.device)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the module docstring in one launch.

    Args:
        gate_up: ``[T, 2I]`` (gate columns first), fp32 / bf16 / fp16, unit stride along the width.

    Returns:
        ``[T, I]``, a new contiguous tensor in gate_up's dtype.

    Raises:
        ValueError: on operands the kernel does not take, or where :func:`is_available` does
            not hold (both name ``fusion.silu_mul``, which takes any).
    """
    problem = _operand_problem(gate_up)
    if problem is not None:
        raise ValueError(f"silu_mul: {problem} (fusion.silu_mul takes any operands)")
    t, width = gate_up.shape
    inter = width // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    if not is_available(gate_up.device):
        raise ValueError(f"silu_mul cannot run on {gate_up.device}: it needs triton and a CUDA GPU "
                         f"(sm80+) or TRITON_INTERPRET=1 on a CPU; use fusion.silu_mul")
    interpret = interpret_mode()
    use_pdl = pdl.active(gate_up.device, interpret)
    _kernels(interpret)[(t, -(-inter // BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0),
        INTER=inter, BLOCK=BLOCK, DTYPE=DTYPE_CODE[gate_up.dtype], PDL=use_pdl,
        LIBDEVICE_EXP=not interpret,
        num_warps=4,
        enable_fp_fusion=False,  # the product rounds once, as torch's does
        **pdl.launch_options(use_pdl),
    )
    return out
