"""benchmarks/bench_prefill.py on the CPU (2 layers, narrow): a row per mode and case, the padded
("graphs") prefills give the eager first token, and a prefill past the largest graph bucket runs
eagerly in both modes (the times are the GPU's: docs/PERFORMANCE.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_prefill_prints_both_modes():
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_prefill.py"), "--device", "cpu", "--layers", "2",
         "--hidden", "256", "--new", "8,40", "--prefix", "0,32", "--rounds", "1"],
        capture_output=True, text=True, timeout=600, cwd=BENCH,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("| ") and "---" not in line and "prefill |" not in line]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (mode, p, n) for mode in ("eager", "graphs") for p in ("0", "32") for n in ("8", "40")]
    assert all(r[-1] == "True" for r in rows)
    assert all(r[4] == "1.00" for r in rows if r[0] == "eager")
    assert "graph buckets (8, 16, 32, 64, 128, 256, 512)" in done.stdout
