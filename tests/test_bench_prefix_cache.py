"""benchmarks/bench_prefix_cache.py on the CPU (2 layers, narrow): every row prints, the cached
runs find the tokens they should (three of four prompts sent together wait for the first one's
prefix) and give the uncached first tokens (the times are the GPU's:
docs/PERFORMANCE.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_prefix_cache_prints_every_row():
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_prefix_cache.py"), "--device", "cpu", "--layers", "2",
         "--hidden", "256", "--context", "64", "--suffix", "16", "--rounds", "1"],
        capture_output=True, text=True, timeout=600, cwd=BENCH,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["same prompt again"][0] == "48"  # 64 tokens, blocks of 16, the last one computed
    assert rows["cached prefix + 16 new"][0] == "64"
    assert rows["batch 4, prefix cached"][0] == "256"
    assert rows["batch 4, cold"][0] == "192"  # three wait for the first one's prefix
    assert rows["batch 4, cold, side by side"][0] == "0"
    assert all(r[4] == "True" and r[3] == "-" for r in rows.values() if r[0] != "cached tokens")
