"""The tensor-parallel benchmark scripts, wired on two CPU ranks (torchrun, gloo): they run and
print their tables (the numbers are timed on GPUs, docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _torchrun(script: str, *args: str, tmp_path: Path) -> str:
    import tp_worker

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(tp_worker.free_port()), str(BENCH / script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bench_allreduce_prints_a_row_per_token_count(tmp_path):
    out = _torchrun("bench_allreduce.py", "--device", "cpu", "--tokens", "1,4", "--repeats", "2",
                    "--ops-per-step", "3", tmp_path=tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "4"]
    assert "gloo" in out


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_bench_tp_runs_both_engines_on_two_ranks(tmp_path, expert_parallel):
    flags = ["--enable-expert-parallel"] if expert_parallel else []
    out = _torchrun("bench_tp.py", "--tp", "2", "--device", "cpu", "--hidden", "256",
                    "--layers", "2", "--context", "32", "--new-tokens", "4", "--batches", "1,2",
                    "--json", str(tmp_path / "rows.jsonl"), *flags, tmp_path=tmp_path)
    assert out.count("| 2 | ") == 2, out  # one row per batch size, printed by rank 0 only
    assert ("experts split by expert" in out) == expert_parallel
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["tp"], r["ep"], r["batch"]) for r in rows] == [(2, expert_parallel, 1),
                                                               (2, expert_parallel, 2)]
    assert all(r["step_ms"] > 0 and r["dflash_tok_s"] > 0 and r["floor_ms"] > 0 for r in rows)
    assert all(r["draft_tp"] == 2 for r in rows)  # auto: the drafter sharded as the target


def test_bench_tp_times_the_sharded_and_the_replicated_drafter(tmp_path):
    out = _torchrun("bench_tp.py", "--tp", "2", "--device", "cpu", "--hidden", "256",
                    "--layers", "2", "--context", "32", "--new-tokens", "4", "--batches", "1",
                    "--draft-tp", "auto,1", "--json", str(tmp_path / "rows.jsonl"), tmp_path=tmp_path)
    assert "DFlash tok/s (drafter split over 2)" in out and "DFlash tok/s (drafter split over 1)" in out
    (row,) = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert (row["draft_tp"], row["draft_tp_1"]) == (2, 1)
    assert row["dflash_tok_s"] > 0 and row["dflash_tok_s_1"] > 0


def test_check_tp_xs_compares_the_sharded_and_replicated_drafter_with_one_process(tmp_path):
    """check_tp_xs.py's wiring on CPU ranks (widths shrunk): its table has a row for each
    drafter setting, the ranks agree, and every step's drafts equal one process's."""
    import re

    done = subprocess.run(
        [sys.executable, str(BENCH / "check_tp_xs.py"), "--device", "cpu", "--hidden", "128",
         "--layers", "2", "--dtypes", "float32", "--new-tokens", "4", "--only-dflash"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| float32 | greedy dflash")]
    assert len(rows) == 2 and "drafter replicated" in rows[1], done.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "True" and cells[3] == "2 of 2 sequences equal", row
        same, total = map(int, re.fullmatch(r"(\d+) of (\d+)", cells[5]).groups())
        assert same == total > 0, row
