"""Real Laguna-XS-2.1 shapes (built on the meta device): parameter counts equal the published
totals (reference/laguna.md section 6.1), so the dummy-weight GPU benchmark measures the real
model: 33,442,617,088 target parameters and 462,064,896 for the XS-2.1 DFlash drafter."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from laguna_dflash.models.laguna import LagunaForCausalLM
from laguna_dflash.models.laguna_dflash import DFlashLaguna, laguna_draft_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu_xs  # noqa: E402


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
