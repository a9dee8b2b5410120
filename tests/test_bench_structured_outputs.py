"""benchmarks/bench_structured_outputs.py: the CPU wiring run prints every (batch, mode) row,
its ratio follows from its rates, and the allow-all constraint left every output unchanged."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_structured_outputs  # noqa: E402
from cpu_bench import printed_ratio_tolerance  # noqa: E402

from laguna_dflash.structured_outputs import unpack_token_bits  # noqa: E402


def test_allow_all_grammar_allows_every_token_in_every_state() -> None:
    grammar = bench_structured_outputs.allow_all_grammar(100)
    state = grammar.initial_state
    for token in (0, 7, 99, 42):
        assert grammar.is_final(state)
        assert bool(unpack_token_bits(grammar.allowed_bits(state).view(1, -1), 100).all())
        state = grammar.next_state(state, token)
    assert state is not None


def test_cpu_wiring_prints_every_row(monkeypatch, capsys) -> None:
    torch.manual_seed(0)
    monkeypatch.setattr(sys, "argv", ["bench_structured_outputs.py", "--device", "cpu", "--layers", "2",
                                      "--hidden", "256", "--context", "24", "--new-tokens", "5",
                                      "--batches", "1,2", "--rounds", "1"])
    bench_structured_outputs.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| [12] \| ", line)]
    assert [r.split("|")[1:3] for r in rows] == [[" 1 ", " target-only "], [" 1 ", " DFlash "],
                                                [" 2 ", " target-only "], [" 2 ", " DFlash "]]
    for row in rows:
        free, constrained, ratio, same = (c.strip() for c in row.strip("|").split("|")[2:])
        assert same == "yes"
        tolerance = printed_ratio_tolerance(float(constrained), float(free), 0.1, 0.1, 0.001)
        assert abs(float(ratio) - float(constrained) / float(free)) <= tolerance


def test_guided_drafts_bench_prints_every_constraint(monkeypatch, capsys) -> None:
    import bench_guided_drafts

    monkeypatch.setattr(sys, "argv", ["bench_guided_drafts.py", "--device", "cpu", "--rounds", "1",
                                      "--new-tokens", "24"])
    bench_guided_drafts.main()
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| constraint")]
    assert [r.split("|")[1].strip() for r in rows] == list(bench_guided_drafts.CONSTRAINTS)
    for row in rows:
        argmax_len, guided_len, argmax_rate, guided_rate, ratio, same = (c.strip() for c in row.strip("|").split("|")[1:])
        assert same == "yes" and float(argmax_len) >= 1 and float(guided_len) >= 1
        tolerance = printed_ratio_tolerance(float(guided_rate), float(argmax_rate), 0.1, 0.1, 0.01)
        assert abs(float(ratio) - float(guided_rate) / float(argmax_rate)) <= tolerance
    assert rows[0].split("|")[2] == rows[0].split("|")[3]  # free: nothing to guide
