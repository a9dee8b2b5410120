"""benchmarks/bench_batch_invariant.py: the CPU wiring run (default mode; the batch-invariant
mode needs CUDA and is refused on the CPU before anything runs in it) prints one row whose
agreement cells count the prompts, and an unknown mode is an error naming ``--modes``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_batch_invariant  # noqa: E402

ARGS = ["bench_batch_invariant.py", "--device", "cpu", "--layers", "2", "--hidden", "256",
        "--context", "40", "--new-tokens", "4", "--prompts", "3", "--agree-tokens", "6"]


def test_cpu_wiring_prints_the_default_row(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ARGS + ["--modes", "default"])
    bench_batch_invariant.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| default |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    for agree in cells[1:3]:  # batched, DFlash: parted / earliest / logprobs differing
        parted, first, logprobs = agree.split(" / ")
        assert 0 <= int(parted) <= 3 and 0 <= int(logprobs) <= 3
        assert (first == "-") == (parted == "0")
    assert all(float(c) > 0 for c in cells[3:6])
    assert re.fullmatch(r"[0-9.]+x", cells[6])


def test_the_invariant_mode_is_refused_on_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ARGS + ["--modes", "batch-invariant"])
    with pytest.raises(ValueError, match="--batch-invariant"):
        bench_batch_invariant.main()


def test_unknown_mode_is_an_error_naming_the_flag(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ARGS + ["--modes", "fast"])
    with pytest.raises(SystemExit):
        bench_batch_invariant.main()
    assert "--modes" in capsys.readouterr().err
