"""benchmarks/bench_draft_quantization.py, a CPU wiring run on the demo pair: one row per dtype
and K, float32 outputs all equal to target-only's (lossless with the drafter in fp8 too)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_draft_quantization  # noqa: E402


def test_cpu_wiring_prints_a_row_per_cell_and_float32_stays_lossless(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_draft_quantization.py", "--dtypes", "float32",
                                      "--ks", "3", "--max-tokens", "12"])
    bench_draft_quantization.main()
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| float32 |")]
    assert len(rows) == 1
    dtype, k, plain, fp8, _change, same = rows[0]
    assert (dtype, k) == ("float32", "3") and float(plain) > 1.0 and float(fp8) > 1.0
    num = same.split(" of ")[1]
    assert same == f"{num}, {num} of {num}", same
