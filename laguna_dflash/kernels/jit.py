"""Shared pieces of the kernels written as plain Python and decorated lazily.

A kernel module keeps its Triton functions as plain Python (triton stays an optional import) and
decorates copies of them with :func:`jit_functions`, bound to one fresh globals dict: helpers
resolve through that dict both compiled and in the CPU interpreter, which looks names up in the
kernel's globals. Triton picks the interpreter from ``TRITON_INTERPRET`` when it decorates (and
at ``import triton``), so the variable must be set before the process imports triton.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import triton.language as tl

# dtype codes of the kernels' constexpr dtype arguments (triton 3.6 does not specialise on dtypes)
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _round_to(x, DTYPE: tl.constexpr):
    # fp32 x -> the nearest value of dtype code DTYPE (0 fp32, 1 bf16, 2 fp16; see DTYPE_CODE),
    # round to nearest even, kept in fp32. bf16 is rounded on the bits (add 0x7fff plus the lowest
    # kept bit, drop the low 16 bits): torch's cast, and exact also in Triton 3.6's CPU
    # interpreter, whose fp32 -> bf16 casts truncate.
    if DTYPE == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def jit_functions(module_name: str, functions: tuple[Callable, ...],
                  do_not_specialize: dict[str, tuple[str, ...]] | None = None) -> dict[str, Callable]:
    """``triton.jit`` copies of ``functions`` sharing one globals dict; returns it by name.
    ``do_not_specialize[name]``: integer arguments of function ``name`` that Triton must not
    specialise on (equal to 1, divisible by 16): one build serves every value."""
    import triton
    import triton.language as tl

    do_not_specialize = do_not_specialize or {}

    namespace = {"__name__": module_name, "__builtins__": __builtins__, "tl": tl, "triton": triton}
    for fn in functions:
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__)
        copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
        copy.__annotations__ = dict(fn.__annotations__)  # the tl.constexpr marks
        namespace[fn.__name__] = triton.jit(copy, do_not_specialize=do_not_specialize.get(fn.__name__))
    return namespace
