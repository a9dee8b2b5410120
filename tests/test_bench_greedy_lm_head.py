"""benchmarks/bench_greedy_lm_head.py's wiring on the CPU, under Triton's interpreter: the table's
rows, and the int8 path's tokens equal to the bf16 path's and the float64 argmax's."""

from __future__ import annotations

from pathlib import Path

import pytest
from interpreter_child import HAS_TRITON, INTERPRETED, run_interpreted_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_greedy_lm_head.py"


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton (runs its own interpreter child)")
def test_bench_greedy_lm_head_tokens_on_the_cpu():
    proc = run_interpreted_script(SCRIPT, "--device", "cpu", "--vocab", "3000", "--hidden", "64", "--m", "1,3",
                                  timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    for r, m in zip(rows, (1, 3)):
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert cells[5] == f"{m} of {m}" and cells[6] == f"{m} of {m}", r
