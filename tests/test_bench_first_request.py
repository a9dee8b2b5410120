"""benchmarks/bench_first_request.py and benchmarks/profile_prefill_xs.py, CPU wiring runs:
one row per scenario and run, a malformed scenario an error naming ``--scenarios``; the prefill
profile prints its table of kernels (aten ops on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_first_request  # noqa: E402
import profile_prefill_xs  # noqa: E402

ARGS = ["bench_first_request.py", "--device", "cpu", "--layers", "2", "--hidden", "256",
        "--max-model-len", "128", "--max-num-seqs", "4", "--scenarios", "1x40x6,3x20x5"]


@pytest.mark.parametrize("k", ["3", "0"])
def test_cpu_wiring_prints_a_row_per_scenario_and_run(monkeypatch, capsys, k) -> None:
    monkeypatch.setattr(sys, "argv", ARGS + ["--k", k])
    bench_first_request.main()
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 1x40x6 |") or line.startswith("| 3x20x5 |")]
    assert [(r[0], r[1]) for r in rows] == [("1x40x6", "first"), ("1x40x6", "repeat"),
                                            ("3x20x5", "first"), ("3x20x5", "repeat")]
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) >= float(r[5]) > 0
        assert r[6] == "0"  # no CUDA graphs on the CPU
    assert f"K {k}," in out


def test_a_malformed_scenario_names_the_flag(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ARGS[:-1] + ["4x1000"])
    with pytest.raises(SystemExit, match="--scenarios"):
        bench_first_request.main()


def test_a_scenario_past_the_model_length_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ARGS[:-1] + ["1x120x20"])
    with pytest.raises(SystemExit, match="--max-model-len"):
        bench_first_request.main()


def test_prefill_profile_prints_its_kernels(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["profile_prefill_xs.py", "--device", "cpu", "--layers", "2",
                                      "--hidden", "256", "--context", "48", "--modes", "default",
                                      "--top", "4"])
    profile_prefill_xs.main()
    out = capsys.readouterr().out
    assert "default: prefill of 48 tokens" in out
    rows = [line for line in out.splitlines() if line.startswith("| aten::")]
    assert len(rows) == 4
    assert all(float(r.split("|")[2]) >= 0 for r in rows)
