"""Run a test file's ``-k interpreted`` tests in a child pytest under Triton's CPU interpreter.

Triton's interpreter needs ``TRITON_INTERPRET=1`` before triton is imported (its standard-library
functions such as ``tl.sum`` are decorated at import, and the package imports triton early), so
the interpreted tests run in ONE child process with the variable set; in the parent they skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
# True in the child process (and wherever the variable is set before triton is imported)
INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child pytest")


def run_interpreted_child(test_file: str, timeout: int = 300) -> None:
    """Every ``interpreted`` test of ``test_file`` passes in the child, and none is skipped."""
    # The interpreter runs tl.dot as numpy's matmul, so an fp32 dot's bits are OpenBLAS's, and
    # OpenBLAS picks its sgemm kernel by CPU. The Zen / Haswell and SkylakeX kernels give an
    # element other bits when its column sits elsewhere in an operand of the same shape. The
    # fused SwiGLU's interleaved weight rows against the plain GEMM's then differ in the last
    # bit (on an AMD EPYC, 2026-12-06), and the tests' bitwise claims would depend on the CPU.
    # The SSE3 kernel (Prescott) gave every element the same bits wherever its column sat, at
    # every shape tried (1-16 rows, 8-64 columns, K 16-32), and runs on any x86-64 CPU.
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_CORETYPE": "Prescott"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted", test_file],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(test_file),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, summary


# what `python SCRIPT ARGS...` does, after installing in the interpreter what the test children
# get from conftest.py: the out-of-bounds checks (interpreter_bounds) and the patching speed-up
_BOOT = (
    "import os, runpy, sys; sys.path.insert(0, {tests!r}); import interpreter_bounds, "
    "interpreter_speedup; sys.path.remove({tests!r}); interpreter_speedup.install(); "
    "interpreter_bounds.install(); sys.argv = sys.argv[1:]; "
    "sys.path[0] = os.path.dirname(sys.argv[0]); runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_interpreted_script(script: str | Path, *args: str, timeout: int = 300,
                           cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python script args...`` under Triton's interpreter (``TRITON_INTERPRET=1``, one
    thread) with every launch's memory accesses checked (:mod:`interpreter_bounds`): an
    out-of-bounds one ends the script with ``OutOfBoundsAccess``. Output captured as text."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    boot = _BOOT.format(tests=str(Path(__file__).resolve().parent))
    return subprocess.run([sys.executable, "-c", boot, str(Path(script).resolve()), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def interpreter_script_json(script: str, timeout: int = 300) -> dict:
    """Run ``python script --interpreter-cases`` under the interpreter (from the repository root)
    and return the JSON object its last output line holds (the script's per-case results)."""
    proc = run_interpreted_script(script, "--interpreter-cases", timeout=timeout,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(script))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
