"""An A/B tool: every Triton kernel's preferred shared-memory carveout set to one value.

An SM splits its 256 KiB between L1 and shared memory per the kernels resident on it, and it
changes the split only when it is empty. Triton marks kernels that need over 48 KiB of shared
memory "prefer shared" and leaves the others to the driver, so a step that mixes a
shared-memory-hungry kernel (kernels/staged_gemv.py: up to ~200 KiB) with small ones may make
SMs drain before the big kernel's programs fit, which would undo programmatic dependent launch.
``install(percent)`` sets ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` on every Triton
kernel loaded from then on and on those already loaded, so every kernel asks for the same split.

    python benchmarks/profile_decode_xs.py --carveout 100 --switch ...
"""

from __future__ import annotations

import ctypes
import gc

_CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


def _set(function: int, percent: int) -> None:
    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuFuncSetAttribute(ctypes.c_void_p(function), ctypes.c_int(_CARVEOUT_ATTRIBUTE),
                                ctypes.c_int(percent))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(carveout={percent}) failed with CUresult {rc}")


def install(percent: int) -> int:
    """Carveout ``percent`` (0..100 of the shared-memory maximum) for every Triton kernel, loaded
    or to be loaded in this process. Returns the number of kernels already loaded and set."""
    import triton
    from triton.compiler.compiler import CompiledKernel

    if not 0 <= percent <= 100:
        raise ValueError(f"--carveout must be a percentage in [0, 100], got {percent}")

    def hook(module, function, name, metadata_group, hash, **kwargs) -> None:  # noqa: A002, ARG001
        if function is not None:
            _set(function, percent)

    triton.knobs.runtime.kernel_load_end_hook.add(hook)
    loaded = [k for k in gc.get_objects() if isinstance(k, CompiledKernel) and getattr(k, "function", None)]
    for kernel in loaded:
        _set(kernel.function, percent)
    return len(loaded)
