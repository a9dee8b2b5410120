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


def test_a_named_pair_and_prompt_file_run_the_same_table(monkeypatch, capsys, tmp_path) -> None:
    """--model / --draft / --prompts / --num-prompts: the A/B on a pair given by path (here the
    demo pair's own directories, as a user passes a real pair's) and the first N prompts of a
    JSON Lines file."""
    from laguna_dflash.demo import demo_pair

    target, draft = demo_pair()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\n"}\n"class Stack:"\n')
    monkeypatch.setattr(sys, "argv", ["bench_draft_quantization.py", "--model", str(target), "--draft", str(draft),
                                      "--prompts", str(prompts), "--num-prompts", "2", "--dtypes", "float32",
                                      "--ks", "3", "--max-tokens", "8"])
    bench_draft_quantization.main()
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{target} with {draft}, 2 prompts, greedy, 8 new tokens, cpu")
    row = [line for line in out.splitlines() if line.startswith("| float32 | 3 |")]
    assert len(row) == 1 and row[0].rstrip(" |").endswith("2, 2 of 2"), row


def test_flag_errors_name_the_flag(monkeypatch, tmp_path) -> None:
    import pytest

    for argv, flag in ((["--model", str(tmp_path)], "--model and --draft"),
                       (["--prompts", str(tmp_path / "missing.jsonl")], "--prompts"),
                       (["--num-prompts", "0"], "--num-prompts")):
        monkeypatch.setattr(sys, "argv", ["bench_draft_quantization.py", *argv])
        with pytest.raises(SystemExit, match=flag):
            bench_draft_quantization.main()
