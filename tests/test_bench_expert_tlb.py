"""benchmarks/bench_expert_tlb.py's id choice and touch offsets (the timing itself needs CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_expert_tlb as tlb  # noqa: E402


def test_ids_are_distinct_routed_experts_then_the_shared_one() -> None:
    gen = torch.Generator().manual_seed(0)
    for mode in tlb.MODES:
        for _ in range(20):
            ids = tlb.choose_ids(mode, 16, 5, gen)
            routed = ids[0, :5].tolist()
            assert ids.shape == (1, 6) and ids[0, 5] == 16
            assert len(set(routed)) == 5 and all(0 <= r < 16 for r in routed)
            if mode == "fresh, contiguous":
                assert routed == list(range(routed[0], routed[0] + 5))
            if mode == "fixed, 0..k-1 in every layer":
                assert routed == [0, 1, 2, 3, 4]


def test_touch_offsets_cover_each_routed_expert_block_at_the_stride() -> None:
    ids = torch.tensor([[3, 0, 7]])  # 7 = E: the shared expert, not touched
    offs = tlb.touch_offsets(ids, expert_numel=10, stride=4, num_experts=7)
    assert offs.tolist() == [30, 34, 38, 0, 4, 8]
