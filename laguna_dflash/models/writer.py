"""Write a model back to a Hugging Face checkpoint directory (the inverse of the loader).

Each parameter group is written in its first (canonical on-disk) spelling: split q/k/v for
targets, per-expert Laguna names, the Poolside fused ``qkv_proj`` for Laguna drafters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_checkpoint(
    model: torch.nn.Module, directory: str | Path, config: dict, dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``config.json`` and the weights for ``model`` into ``directory``.

    One ``model.safetensors``, or with ``max_shard_bytes`` HF-style shards
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    if getattr(getattr(model, "tp", None), "is_parallel", False):
        raise ValueError("save_checkpoint got one tensor-parallel rank's shard of a model; save "
                         "a model built with tensor_parallel_size=1")
    for options in model.checkpoint_groups():
        for name, tensor, *_ in options[0]:
            t = tensor.detach().to("cpu")
            if dtype is not None and t.is_floating_point() and not name.endswith("e_score_correction_bias"):
                t = t.to(dtype)
            tensors[name] = t.contiguous().clone()
    for stale in directory.glob("model*.safetensors*"):
        stale.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
