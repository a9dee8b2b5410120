"""Shared training plumbing: device/dtype setup, LR schedule, resumable checkpoints."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op context on CPU (float32 training)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               extra: dict | None = None) -> None:
    """Atomically write a resumable training state (weights, optimizer, step, RNG)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "torch_rng": torch.get_rng_state(), "extra": extra or {}}, tmp)
    tmp.replace(path)


def load_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict]:
    """Resume from ``path`` if it exists: returns (next step, extra); (0, {}) otherwise."""
    if not path.is_file():
        return 0, {}
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    logger.info("resumed from %s at step %d", path, state["step"])
    return int(state["step"]), state.get("extra", {})


def balance_moe_(model: torch.nn.Module, rate: float) -> None:
    """Aux-loss-free load balancing (arXiv 2408.15664): nudge each MoE layer's
    ``e_score_correction_bias`` up for under-loaded experts and down for over-loaded ones."""
    for module in model.modules():
        ids = getattr(module, "last_expert_ids", None)
        if ids is None:
            continue
        load = torch.bincount(ids.reshape(-1), minlength=module.num_experts).float()
        with torch.no_grad():
            module.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
        module.last_expert_ids = None
