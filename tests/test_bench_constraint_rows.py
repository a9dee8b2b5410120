"""benchmarks/bench_constraint_rows.py: a small trained BPE gives a row per constraint, each
with a compile time and positive row costs; the regex automaton's second walk (its states'
bit sets cached) is faster than its first."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_constraint_rows  # noqa: E402


def test_prints_a_row_per_constraint(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_constraint_rows.py", "--vocab", "800", "--corpus-mb", "1",
                                      "--drafts", "3"])
    bench_constraint_rows.main()
    out = capsys.readouterr().out
    assert "a byte-level BPE of 800 ids" in out
    rows = {m.group(1): [float(x) for x in m.group(2).split("|")]
            for m in re.finditer(r"^\| ([^|]+?) \| ([0-9.| ]+) \|$", out, re.M)}
    assert list(rows) == ["regex (a function)", "grammar (the same function, GBNF)", "JSON schema"]
    for name, (compile_s, num_tokens, num_rows, first, second) in rows.items():
        assert compile_s > 0 and first > 0 and second > 0, name
        assert num_tokens < num_rows <= num_tokens * 4, name  # a block of 3 drafts + 1 a token
    assert rows["regex (a function)"][4] < rows["regex (a function)"][3]
