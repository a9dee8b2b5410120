"""``benchmarks/verify_floor.py``: the expert-union counts and the byte count it builds its
floors from (the whole script builds full-width layers: a GPU-session tool, not run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import verify_floor  # noqa: E402
from bench_gpu_xs import active_bytes, xs_target_config  # noqa: E402


def test_mean_union_counts_distinct_ids_per_window() -> None:
    ids = torch.tensor([[0, 1], [1, 2], [3, 4]])
    assert verify_floor.mean_union(ids, 1) == 2
    assert verify_floor.mean_union(ids, 2) == (3 + 4) / 2  # {0, 1, 2}, {1, 2, 3, 4}
    assert verify_floor.mean_union(ids, 3) == 5


def test_expected_union_of_uniform_choices() -> None:
    assert verify_floor.expected_union(4, 2, 1) == pytest.approx(2)
    assert verify_floor.expected_union(4, 2, 2) == pytest.approx(3)  # 4 (1 - (1/2)^2)
    assert verify_floor.expected_union(256, 8, 64) < 256


def test_target_bytes_is_active_bytes_at_top_k_and_grows_by_whole_experts() -> None:
    model = verify_floor.meta_model(xs_target_config(3)).to(torch.bfloat16)
    moe = model.spec.moe
    base = verify_floor.target_bytes(model, 1024, moe.top_k)
    assert base == pytest.approx(active_bytes(model, 1024))
    expert = 3 * 512 * 2048 * 2  # gate, up, down of one XS-2.1 expert in bf16
    num_sparse = xs_target_config(3)["mlp_layer_types"].count("sparse")
    assert verify_floor.target_bytes(model, 1024, moe.top_k + 1) - base == pytest.approx(expert * num_sparse)
