"""``benchmarks/bench_handoff.py``: its chains compute what they should (the CPU wiring run under
the interpreter checks the values) and its persistent kernel's grid barrier is what the docstring
says in the sm_90 build (one release atomic a program, acquire loads in the spin, no atomics in
the kernel-per-step variant, the PDL wait before the read)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from interpreter_child import HAS_TRITON, INTERPRETED, run_interpreted_script
from ptx_sm90 import can_compile_sm90, compile_sm90

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton (runs its own interpreter child)")
def test_cpu_wiring_under_the_interpreter() -> None:
    proc = run_interpreted_script(ROOT / "benchmarks" / "bench_handoff.py", "--device", "cpu", "--tiny")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2 and all(line.endswith("| ok |") for line in rows), out


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_handoff_code() -> None:
    import bench_handoff

    step, persistent = bench_handoff._kernels()
    ptx = compile_sm90(persistent, {"buf_ptr": "*i32", "count_ptr": "*i32"}, {"NUM_STEPS": 200}, {"num_warps": 1})
    assert ptx.count("atom.global.gpu.release.add") == 1  # the arrival: once in the step loop (not unrolled at 200)
    assert "ld.global.gpu.acquire" in ptx and "ld.global.cg" in ptx
    ptx = compile_sm90(step, {"src_ptr": "*i32", "dst_ptr": "*i32"}, {"PDL": True},
                       {"num_warps": 1, "launch_pdl": True})
    assert "atom" not in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global.cg") < ptx.index("griddepcontrol.launch")
