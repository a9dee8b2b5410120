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
    model: torch.nn.Module, directory: str | Path, config: dict, dtype: torch.dtype | None = None
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``model`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for options in model.checkpoint_groups():
        for name, tensor in options[0]:
            t = tensor.detach().to("cpu")
            if dtype is not None and t.is_floating_point() and not name.endswith("e_score_correction_bias"):
                t = t.to(dtype)
            tensors[name] = t.contiguous().clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
