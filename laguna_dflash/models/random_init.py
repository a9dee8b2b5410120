"""Random-weight checkpoints in the real on-disk formats (demo before training, smoke tests).

``write_random_pair(dir)`` writes ``dir/target`` (a tiny Laguna MoE with sliding and full
layers, gating, shared expert) and ``dir/draft`` (a Poolside-format Laguna DFlash drafter).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .laguna import LagunaForCausalLM
from .laguna_dflash import DFlashLaguna
from .writer import save_checkpoint


def small_rope_parameters() -> dict:
    """Laguna's RoPE layout at small scale: partial YaRN on full layers, plain on sliding."""
    return {
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                           "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                           "beta_slow": 1.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 1.0},
    }


def tiny_laguna_config(vocab_size: int = 512, num_layers: int = 4, hidden_size: int = 64) -> dict:
    """A small config with every Laguna feature the releases use (SWA/full mix, YaRN, MoE)."""
    layer_types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    return {
        "architectures": ["LagunaForCausalLM"], "model_type": "laguna",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_attention_heads_per_layer": [4 if t == "full_attention" else 8 for t in layer_types],
        "layer_types": layer_types, "sliding_window": 64, "gating": "per-head",
        "mlp_layer_types": ["dense"] + ["sparse"] * (num_layers - 1),
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden_size,
        "shared_expert_intermediate_size": hidden_size, "moe_routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": small_rope_parameters(),
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }


def tiny_laguna_draft_config(target_cfg: dict, num_layers: int = 2, block_size: int = 8,
                             mask_token_id: int = 3) -> dict:
    """A Poolside-format ``DFlashLagunaForCausalLM`` config for ``target_cfg``."""
    depth = target_cfg["num_hidden_layers"]
    taps = sorted({1 % depth, depth // 2, depth - 1})
    hidden = target_cfg["hidden_size"]
    return {
        "architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna",
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": num_layers,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "sliding_window": target_cfg.get("sliding_window", 512),
        "layer_types": ["sliding_attention"] * num_layers, "gating": "per-head", "num_experts": 0,
        "vocab_size": target_cfg["vocab_size"], "draft_vocab_size": target_cfg["vocab_size"],
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in taps],
        "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                          "num_target_layers": depth, "target_layer_ids": taps, "causal": True},
    }


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Scaled normal init in place (on the parameters' device): matrices ``N(0, 1/fan_in)``,
    norms ``1 + 0.1 N``, other vectors ``0.01 N``. Deterministic for a seed and device.

    A tensor-parallel rank's model (``model.tp``) gets its part of the values the one-rank
    model gets: each sharded parameter is drawn whole, in the same order, and its
    :class:`~laguna_dflash.distributed.Split` kept, so ``--load-format dummy`` builds the same
    model at every rank count."""
    devices = {p.device for p in model.parameters()}
    g = torch.Generator(device=next(iter(devices))).manual_seed(seed)
    splits = _parameter_splits(model)
    for name, p in sorted(model.named_parameters()):
        split = splits.get(id(p))
        full = p if split is None else p.new_empty(split.disk_shape(tuple(p.shape)))
        if p.dim() >= 2:
            full.normal_(0.0, 1.0 / math.sqrt(full.shape[-1]), generator=g)
        elif name.endswith("norm.weight") or ".aux_hidden_norms." in name:
            full.normal_(1.0, 0.1, generator=g)
        else:
            full.normal_(0.0, 0.01, generator=g)
        if split is not None:
            p.copy_(split.read(full))


def _parameter_splits(model: torch.nn.Module) -> dict:
    """id(parameter) -> its Split, for the parameters a tensor-parallel rank holds a part of:
    the loader's on-disk spellings that map one whole parameter (their disk layout is the
    one-rank parameter's). Empty for one rank."""
    tp = getattr(model, "tp", None)
    if tp is None or not tp.is_parallel or not hasattr(model, "checkpoint_groups"):
        return {}
    params = {(p.data_ptr(), tuple(p.shape)): p for p in model.parameters()}
    splits = {}
    for options in model.checkpoint_groups():
        for option in options:
            for _name, dest, *split in option:
                p = params.get((dest.data_ptr(), tuple(dest.shape)))
                if p is not None and split and split[0] is not None:
                    splits[id(p)] = split[0]
    return splits


def write_random_pair(directory: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Write a random tiny Laguna target and Laguna DFlash drafter; returns (target, draft)."""
    directory = Path(directory)
    tcfg = tiny_laguna_config()
    target = LagunaForCausalLM.from_config(tcfg)
    randomize_(target, seed)
    tdir = save_checkpoint(target, directory / "target", tcfg)
    dcfg = tiny_laguna_draft_config(tcfg)
    draft = DFlashLaguna.from_config(dcfg, {}, target)
    randomize_(draft, seed + 1)
    ddir = save_checkpoint(draft, directory / "draft", dcfg)
    return tdir, ddir


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "random-pair"
    t, d = write_random_pair(out)
    print(f"wrote {t} and {d}")
