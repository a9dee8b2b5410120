"""``benchmarks/bench_gemv_formulations.py``: its vec-acc GEMV kernel is right (the script's CPU
wiring run under the interpreter checks every variant against an fp64 reference) and compiles for
sm_90 the way its docstring says (offline: no shuffle or shared memory in the K loop, no spills,
``DEPTH`` weight tiles loaded before the loop in the PTX; ptxas may still unroll the loop and
schedule the loads itself, which is why the script times it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from interpreter_child import HAS_TRITON, INTERPRETED, run_interpreted_script
from ptx_sm90 import can_compile_sm90, compile_sm90_spills

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton (runs its own interpreter child)")
def test_cpu_wiring_under_the_interpreter() -> None:
    proc = run_interpreted_script(ROOT / "benchmarks" / "bench_gemv_formulations.py", "--device", "cpu",
                                  "--tiny", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 4 and not any("wrong" in line for line in rows), out


def _loop_body(ptx: str) -> str:
    lines = ptx.splitlines()
    start = next(i for i, line in enumerate(lines) if "Loop Header" in line)
    label = lines[start].split(":")[0].strip()
    end = next(j for j in range(start, len(lines)) if "bra" in lines[j] and label in lines[j])
    return "\n".join(lines[start:end + 1])


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_code_of_the_timed_variants() -> None:
    import bench_gemv_formulations as bench

    kernel = bench.kernel(False)
    for bn, bk, depth, nw in bench.VARIANTS:
        ptx, spills = compile_sm90_spills(
            kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"},
            dict(K=2048, BLOCK_N=bn, BLOCK_K=bk, VEC=bench.VEC, DEPTH=depth, K_ITERS=2048 // bk),
            {"num_warps": nw})
        body = _loop_body(ptx)
        assert "shfl" not in body and "st.shared" not in body and "bar.sync" not in body, (bn, bk, depth)
        assert spills and max(spills) == 0, (bn, bk, depth, spills)
        before = ptx[:ptx.index("Loop Header")]
        weight_loads = sum("ld.global" in line and "evict_first" in line for line in before.splitlines())
        per_tile = bn * bk * 2 // (16 * 32 * nw)  # 16-byte loads a thread per weight tile
        assert weight_loads == depth * per_tile, (bn, bk, depth, weight_loads)
