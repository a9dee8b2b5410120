"""Real Laguna-XS-2.1 shapes (built on the meta device): parameter counts equal the published
totals (reference/laguna.md section 6.1), so the dummy-weight GPU benchmark measures the real
model: 33,442,617,088 target parameters and 462,064,896 for the XS-2.1 DFlash drafter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from laguna_dflash.models.laguna import LagunaForCausalLM
from laguna_dflash.models.laguna_dflash import DFlashLaguna, laguna_draft_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu_xs  # noqa: E402
import bench_tp  # noqa: E402

from laguna_dflash.distributed import TensorParallel  # noqa: E402


def test_xs_21_parameter_counts_match_the_release():
    with torch.device("meta"):
        target = LagunaForCausalLM.from_config(bench_gpu_xs.xs_target_config(40))
        drafter = DFlashLaguna(laguna_draft_spec(bench_gpu_xs.xs_draft_config(40), {}, target), target)
    assert sum(p.numel() for p in target.parameters()) == 33_442_617_088
    assert sum(p.numel() for p in drafter.parameters()) == 462_064_896
    spec = target.spec
    assert [layer.num_heads for layer in spec.layers[:4]] == [48, 64, 64, 64]
    assert sum(layer.sliding_window is None for layer in spec.layers) == 10
    assert spec.layers[0].rope.rotary_dim == 64 and spec.layers[1].rope.rotary_dim == 128
    # the benchmark's bandwidth floor counts the published 2,811,614,976 active parameters per
    # token (lm_head included, input embedding excluded); meta parameters are float32 here
    assert bench_gpu_xs.active_bytes(target, context=0) // 4 == 2_811_614_976


def _sharded_parameter_counts(cfg: dict, world_size: int,
                              expert_parallel: bool = False) -> list[tuple[tuple, tuple]]:
    """(rank-0 shape, single-process shape) of every parameter, in order (meta device)."""
    with torch.device("meta"):
        one = LagunaForCausalLM.from_config(cfg)
        tp = TensorParallel(0, world_size, expert_parallel=expert_parallel)
        sharded = LagunaForCausalLM.from_config(cfg, tp=tp)
    pairs = [(tuple(a.shape), tuple(b.shape)) for a, b in zip(sharded.parameters(), one.parameters())]
    assert len(pairs) == len(list(one.parameters()))
    return pairs


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_s_21_shards_over_2_4_8_ranks_and_fits_two_h200s(expert_parallel):
    """Laguna-S-2.1 (117,561,977,600 parameters, more than one H200 holds in bf16): at 2, 4 and
    8 ranks every parameter is either replicated or split evenly, so the ranks together hold
    the model exactly once plus the replicated ones; at 2 ranks a rank's bf16 weights fit an
    H200 with room for the KV cache. With expert parallelism (whole experts a rank) too."""
    cfg = bench_tp.s21_target_config()
    with torch.device("meta"):
        assert sum(p.numel() for p in LagunaForCausalLM.from_config(cfg).parameters()) == 117_561_977_600
    for world in (2, 4, 8):
        pairs = _sharded_parameter_counts(cfg, world, expert_parallel)
        total = replicated = per_rank = 0
        for local, full in pairs:
            n_local, n_full = torch.Size(local).numel(), torch.Size(full).numel()
            per_rank += n_local
            if local == full:
                replicated += n_full
                total += n_full
            else:
                assert n_local * world == n_full, (local, full)
                if expert_parallel and len(full) == 3:  # [E, ., .]: split by expert, width whole
                    assert local[0] * world == full[0] and local[1:] == full[1:], (local, full)
                total += n_full
        assert total == 117_561_977_600
        # replicated: norms, routers (and their biases): small
        assert replicated < 0.01 * total
        if world == 2:
            assert per_rank * 2 / 2**30 < 115, per_rank  # GiB of bf16 weights on one of two H200s


def test_bench_batches_decode_distinct_prompts():
    # copies of one prompt decode the same greedy tokens in every row (one expert set a layer
    # for the whole batch): the batch cells must time distinct prompts of the same length
    prompt = list(range(100, 1124))
    prompts = bench_gpu_xs.batch_prompts(prompt, 64)
    assert prompts[0] == prompt and len({tuple(p) for p in prompts}) == 64
    assert all(sorted(p) == prompt for p in prompts)
