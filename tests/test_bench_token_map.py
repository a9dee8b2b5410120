"""benchmarks/bench_token_map.py, a CPU wiring run on the demo pair: one row per map size and K,
every output equal to target-only's (only the drafts change), and a map smaller than the
vocabulary covering less of the outputs than a larger one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_token_map  # noqa: E402


def test_cpu_wiring_prints_a_row_per_map_and_stays_lossless(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_token_map.py", "--sizes", "256,2048", "--ks", "3",
                                      "--max-tokens", "12", "--num-prompts", "3", "--max-bytes", "300000"])
    bench_token_map.main()
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "%" in line]
    assert [(r[0], r[2]) for r in rows] == [("256", "3"), ("2048", "3")]
    coverages = [float(r[1].rstrip("%")) for r in rows]
    assert 0 < coverages[0] < coverages[1] <= 100
    for row in rows:
        assert float(row[3]) >= 1.0 and row[4] == rows[0][4]  # one whole-vocabulary run a K
        assert row[6] == "3 of 3", row
