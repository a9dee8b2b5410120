"""Offline sm_90 (H100 / H200) compile of a Triton kernel to PTX: no driver, no GPU.

Used by the kernel tests to check what the GPU would run (loop bodies, load kinds, the order of
``griddepcontrol`` instructions) on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator

from interpreter_child import HAS_TRITON, INTERPRETED


def can_compile_sm90() -> bool:
    """Triton's CUDA backend importable, and this process not under the interpreter."""
    if not HAS_TRITON or INTERPRETED:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return True


_lock_depth = 0  # this process's holds of the lock below (a nested hold must not flock again)


@contextlib.contextmanager
def sm90_compile_lock() -> Iterator[None]:
    """One offline sm_90 build (a Triton compile, which runs ptxas, or a ``ptxas -v``) at a time
    across the processes of this machine: with 12 pytest-xdist workers compiling at once on the
    H200's host, triton's ``ptxas`` exited 255 and the same tests passed serially (twentieth and
    thirty-second passes, docs/PERFORMANCE.md). Reentrant within a process."""
    global _lock_depth
    if _lock_depth:
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
        return
    with open(os.path.join(tempfile.gettempdir(), "laguna_dflash_sm90_compile.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _lock_depth = 1
        try:
            yield
        finally:
            _lock_depth = 0
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, options: dict) -> str:
    """PTX of ``kernel`` (a ``triton.jit`` function) for sm_90 through ptxas.

    ``types``: argument name -> type (``"*bf16"``, ``"fp32"``...); ``constexprs``: the constexpr
    arguments' values (unit strides may be given here too: triton specialises them the same
    way); every other argument is an i32 scalar; ``options``: compile options (``num_warps``,
    ``num_stages``, ``launch_pdl``...). Pointer and i32 arguments but ``M`` are marked
    16-divisible, as triton does for aligned launches.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {a: types.get(a, "constexpr" if a in constexprs else "i32") for a in kernel.arg_names}
    divisible = [i for i, a in enumerate(kernel.arg_names)
                 if signature[a] == "i32" and a != "M" or signature[a].startswith("*")]
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    with sm90_compile_lock():
        return compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def compile_gluon_sm90(kernel, types: dict[str, str], constexprs: dict, options: dict) -> str:
    """:func:`compile_sm90` for a Gluon kernel (``gluon.jit``): ``types`` must name every
    non-constexpr argument (tensor descriptors as ``tensordesc<bf16[8, 256],NVMMASharedLayout(...)>``);
    pointer arguments are marked 16-divisible."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    signature = {a: "constexpr" if a in constexprs else types[a] for a in names}
    src = GluonASTSource(fn=kernel, signature=signature,
                         constexprs={(names.index(a),): v for a, v in constexprs.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                                if signature[a].startswith("*")})
    with sm90_compile_lock():
        return compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def ptxas_spills(ptx: str) -> list[int]:
    """``ptxas -v`` (triton's own) on ``ptx`` for sm_90a: the spill-store bytes of each function."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp, sm90_compile_lock():
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".o"],
                              capture_output=True, text=True)
    if proc.returncode != 0:  # the message, not only the exit status, in the test's failure
        raise RuntimeError(f"ptxas exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return [int(x) for x in re.findall(r"(\d+) bytes spill stores", proc.stderr)]


def compile_sm90_spills(kernel, types: dict[str, str], constexprs: dict, options: dict) -> tuple[str, list[int]]:
    """:func:`compile_sm90`, then ``ptxas -v`` (triton's own) on the PTX: (PTX, spill-store bytes
    of each function)."""
    ptx = compile_sm90(kernel, types, constexprs, options)
    return ptx, ptxas_spills(ptx)


def loads_before_pdl_wait(ptx: str) -> list[str]:
    """Checks the programmatic-dependent-launch order of one kernel's PTX (kernels/pdl.py):
    exactly one ``griddepcontrol.wait``, and ``launch_dependents`` after it. Returns the global
    loads (``ld.global`` / ``cp.async``) issued before the wait, for the caller to check."""
    assert ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("griddepcontrol.launch_dependents")
    return [line.strip() for line in ptx[:wait].splitlines() if "ld.global" in line or "cp.async" in line]
