"""benchmarks/bench_greedy_lm_head.py's wiring on the CPU, under Triton's interpreter: the table's
rows, and the int8 path's tokens (at two exact-pass chunk sizes) equal to the bf16 path's and the
float64 argmax's, and the candidate counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from interpreter_child import HAS_TRITON, INTERPRETED, run_interpreted_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_greedy_lm_head.py"


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton (runs its own interpreter child)")
def test_bench_greedy_lm_head_tokens_on_the_cpu():
    proc = run_interpreted_script(SCRIPT, "--device", "cpu", "--vocab", "3000", "--hidden", "64", "--m", "1,3",
                                  "--exact-chunks", "2048,256", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    for r, m in zip(rows, (1, 3)):
        cells = [c.strip() for c in r.strip("|").split("|")]
        # rows, bf16, int8 alone, one time per exact chunk (2), ratio, then the tokens' columns
        assert cells[6] == f"{m} of {m} / {m} of {m}" and cells[7] == cells[6], r
        assert all(1 <= int(n) < 3000 for n in cells[8].split(",")) and "(256)" in cells[9], r


def test_count_greedy_candidates_on_the_demo_target():
    """benchmarks/count_greedy_candidates.py on the embedded demo target (a trained model): every
    step's exact argmax is a candidate and the generated token (else it exits 1), and the summary
    gives this model's counts and the Gaussian baseline's."""
    import re
    import subprocess
    import sys

    script = SCRIPT.parent / "count_greedy_candidates.py"
    proc = subprocess.run([sys.executable, str(script), "--prompts", "1", "--new-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = re.search(r"prompt 0: candidates a step \[([0-9, ]+)\]", proc.stdout)
    assert row and len(row.group(1).split(",")) == 4 and all(int(c) >= 1 for c in row.group(1).split(","))
    assert "this model: median" in proc.stdout and "Gaussian weights of the same shape: median" in proc.stdout
