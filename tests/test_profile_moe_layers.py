"""benchmarks/profile_decode_xs.py's moe_layers: the folded MoE blocks in layer order (what
--moe-only times on the loaded engine's tensors)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_moe_layers_are_the_folded_moe_blocks_in_order() -> None:
    from profile_decode_xs import moe_layers

    from laguna_dflash.models import layers
    from laguna_dflash.models.laguna import LagunaForCausalLM
    from laguna_dflash.models.random_init import tiny_laguna_config

    model = LagunaForCausalLM.from_config(tiny_laguna_config())
    every = [m for m in model.modules() if isinstance(m, layers.MoE)]
    assert every and moe_layers(model) == []  # nothing folded yet
    layers.fuse_for_inference(model)
    found = moe_layers(model)
    assert found == [m for m in every if m.gate_up_with_shared is not None] and found
    for m in found:
        gate_up, down = m.fused_experts()
        assert gate_up.shape[0] == m.num_experts + 1 and down.shape[0] == m.num_experts + 1
