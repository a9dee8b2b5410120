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
    thirty-second passes, docs/PERFORMANCE.md). The thirty-fourth pass found a likelier cause of
    those exits, a worker's PTX written for another ptxas (:func:`pinned_options`); the lock stays,
    it costs little. Reentrant within a process."""
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
        return compile(src, target=GPUTarget("cuda", 90, 32), options=pinned_options(options)).asm["ptx"]


def compile_gluon_sm90(kernel, types: dict[str, str], constexprs: dict, options: dict,
                       divisible: tuple[str, ...] = ()) -> str:
    """:func:`compile_sm90` for a Gluon kernel (``gluon.jit``): ``types`` must name every
    non-constexpr argument (tensor descriptors as ``tensordesc<bf16[8, 256],NVMMASharedLayout(...)>``);
    pointer arguments are marked 16-divisible, and the integer arguments named in ``divisible``
    (as triton does at a launch where their value is)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    signature = {a: "constexpr" if a in constexprs else types[a] for a in names}
    src = GluonASTSource(fn=kernel, signature=signature,
                         constexprs={(names.index(a),): v for a, v in constexprs.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                                if signature[a].startswith("*") or a in divisible})
    with sm90_compile_lock():
        return compile(src, target=GPUTarget("cuda", 90, 32), options=pinned_options(options)).asm["ptx"]


def checks_ptxas():
    """The sm_90 checks' ptxas (``triton.knobs.NvidiaTool``: ``path``, ``version``): Triton's
    bundled one whatever ``TRITON_PTXAS_PATH`` says (the one Triton builds with until something,
    torch's inductor for one, sets that variable), or ``SM90_CHECK_PTXAS=/path/to/ptxas`` (the
    PTX version and the spill counts both follow it)."""
    import triton

    path = os.environ.get("SM90_CHECK_PTXAS") or os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    tool = triton.knobs.NvidiaTool.from_path(path)
    if tool is None:
        raise RuntimeError(f"{path} did not report its release (ptxas --version)")
    return tool


def pinned_options(options: dict) -> dict:
    """``options`` with the PTX version of :func:`checks_ptxas` (unless given).

    Triton writes the PTX version of the ptxas it will call: ``TRITON_PTXAS_PATH``, else its
    bundled one. Once a process has run torch's inductor, that variable names torch's own ptxas
    (``torch._inductor.runtime.compile_tasks._set_triton_ptxas_path``); on the H200's host (torch
    2.11+cu130) that one is CUDA 13.0's and writes PTX 9.0, which the bundled ptxas (CUDA 12.8)
    rejects. One pytest worker in twelve failed its eight sm_90 checks that way (thirty-fourth
    pass), and a process's first ptxas release keys triton's cache for the rest of it. Pinned,
    the PTX and the spill counts do not depend on what ran before in the process. The older of
    the two ptxas' versions, so that triton's own build of the PTX (with the knob's ptxas) takes
    it too; the code is the same, as triton caps LLVM's PTX features at 8.6 either way."""
    import triton
    from triton.backends.nvidia.compiler import ptx_get_version

    version = min(ptx_get_version(checks_ptxas().version),
                  ptx_get_version(triton.knobs.nvidia.ptxas.version))
    return {"ptx_version": version, **options}


def _ptxas_report(ptx: str) -> str:
    # ``ptxas -v`` (:func:`checks_ptxas`) on ``ptx`` for sm_90a: its report (stderr)
    tool = checks_ptxas()
    with tempfile.TemporaryDirectory() as tmp, sm90_compile_lock():
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([tool.path, "-arch=sm_90a", "-v", path, "-o", path + ".o"],
                              capture_output=True, text=True)
    if proc.returncode != 0:  # the message, not only the exit status, in the test's failure
        raise RuntimeError(f"{tool.path} (release {tool.version}) exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return proc.stderr


def ptxas_spills(ptx: str) -> list[int]:
    """``ptxas -v`` (:func:`checks_ptxas`) on ``ptx`` for sm_90a: the spill-store bytes of each
    function."""
    return [int(x) for x in re.findall(r"(\d+) bytes spill stores", _ptxas_report(ptx))]


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
