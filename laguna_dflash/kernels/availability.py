"""Where the Triton kernels can run: triton importable, and a CUDA device (of a minimum compute
capability) or a CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def import_triton() -> tuple[ModuleType | None, ModuleType | None]:
    """``(triton, triton.language)``, or ``(None, None)`` where triton is not installed: a kernel
    module defines its ``@triton.jit`` functions only when it got triton, and still imports on
    a CPU-only install."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None, None
    return triton, tl


@functools.cache
def triton_importable() -> bool:
    return import_triton()[0] is not None


def interpret_mode() -> bool:
    """Whether triton decorates kernels for its CPU interpreter now (``TRITON_INTERPRET=1``,
    read by triton when a function is decorated, not at import)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


@functools.cache
def cuda_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def triton_can_run(device: torch.device | str, min_major: int = 0) -> bool:
    """Triton importable and ``device`` is a CUDA device of compute capability ``>= min_major``
    (8 for bf16 ``tl.dot``), or a CPU while the interpreter is on."""
    device = torch.device(device)
    if not triton_importable():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and cuda_capability(device.index)[0] >= min_major
    return device.type == "cpu" and interpret_mode()
