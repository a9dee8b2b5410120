"""benchmarks/bench_chunked_prefill.py on the CPU (2 layers, narrow): every row prints, the
running request gets tokens between the chunks (none during a whole-prompt prefill), and the
long prompt's first tokens are the unchunked ones (times: docs/PERFORMANCE.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_chunked_prefill_rows():
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_chunked_prefill.py"), "--device", "cpu", "--layers",
         "2", "--hidden", "256", "--context", "256", "--chunks", "64", "--rounds", "1"],
        capture_output=True, text=True, timeout=600, cwd=BENCH,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["whole prompt (no chunking)"][1] == "0"
    assert int(rows["chunks of 64"][1]) >= 3  # a decode step between each of the 4 chunks
    assert all(r[3] == "True" for name, r in rows.items() if name != "prefill")
