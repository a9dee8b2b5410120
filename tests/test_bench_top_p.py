"""benchmarks/bench_top_p.py: the CPU wiring run prints a row per shape and row count, and the
baseline it times (the sort + scatter the sampler ran before the kernel) keeps the same tokens as
the new definition wherever the boundary token has no tie."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_top_p  # noqa: E402

from laguna_dflash.kernels import top_p as tp  # noqa: E402


def test_cpu_wiring_prints_a_row_per_case(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_top_p.py", "--device", "cpu", "--vocab", "300",
                                      "--rows", "1,3", "--iters", "1"])
    bench_top_p.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| flat") or
            line.startswith("| peaked")]
    assert len(rows) == 4
    assert all(float(cell) > 0 for row in rows for cell in row.strip("| ").split(" | ")[3:5])


def test_old_sort_keeps_the_new_set_without_ties() -> None:
    # float32 softmax of float32 logits: no two probabilities equal, so ties cannot differ
    probs = torch.softmax(3 * torch.randn(8, 5000, generator=torch.Generator().manual_seed(0)), dim=-1)
    for bound in (0.1, 0.5, 0.9, 0.99):
        old = bench_top_p.sort_scatter_top_p(probs, bound)
        assert torch.equal(old > 0, tp.top_p_filter_reference(probs, bound) > 0), bound
