"""benchmarks/bench_adaptive_ab.py: the CPU wiring run prints every variant for every batch
size, the ratios follow from the rates, and the step log counts every timed decode step."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_adaptive_ab  # noqa: E402
from cpu_bench import printed_ratio_tolerance  # noqa: E402


def test_cpu_wiring_prints_every_row(monkeypatch, capsys) -> None:
    new_tokens = 5
    monkeypatch.setattr(sys, "argv", ["bench_adaptive_ab.py", "--device", "cpu", "--layers", "2",
                                      "--hidden", "256", "--context", "24", "--new-tokens", str(new_tokens),
                                      "--batches", "1,2", "--rounds", "1", "--max-k", "3"])
    bench_adaptive_ab.main()
    out = capsys.readouterr().out.splitlines()
    rates = [line for line in out if re.match(r"\| [12] \| [0-9.]+ \(", line)]
    assert len(rates) == 2
    for row in rates:
        cells = row.strip("|").split("|")[1:]
        assert len(cells) == 4  # target-only, fixed K = 0, fixed K = 3, adaptive
        values = [re.match(r" ([0-9.]+) \(([0-9.]+)x\)", c).groups() for c in cells]
        base = float(values[0][0])
        assert float(values[0][1]) == 1.0
        for rate, ratio in values:
            # rates printed to 0.1, ratios to 0.001
            tolerance = printed_ratio_tolerance(float(rate), base, 0.1, 0.1, 0.001)
            assert float(rate) > 0 and abs(float(ratio) - float(rate) / base) <= tolerance
    logs = [line for line in out if re.match(r"\| [12] \| \{", line)]
    assert len(logs) == 2
    for row in logs:
        ks = ast.literal_eval(row.split("|")[2].strip())
        # the first token comes from the prefill: every other token of the run is one decode step
        # (L = 1: nothing accepted), whatever K each step chose
        assert sum(ks.values()) == new_tokens - 1, ks
