"""HF ``architectures`` string -> model class, imported lazily."""

from __future__ import annotations

import importlib

# architecture -> (module, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "LagunaForCausalLM": ("laguna_dflash.models.laguna", "LagunaForCausalLM"),
    "Qwen3ForCausalLM": ("laguna_dflash.models.qwen3", "Qwen3ForCausalLM"),
    "DFlashDraftModel": ("laguna_dflash.models.dflash", "DFlashDraftModel"),
    "DFlashQwen3ForCausalLM": ("laguna_dflash.models.dflash", "DFlashDraftModel"),
    "DFlashLagunaForCausalLM": ("laguna_dflash.models.laguna_dflash", "DFlashLaguna"),
}

DRAFT_ARCHITECTURES = frozenset(
    {"DFlashDraftModel", "DFlashQwen3ForCausalLM", "DFlashLagunaForCausalLM"}
)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(architecture: str) -> type:
    """Model class for an ``architectures`` entry; unknown names list the supported ones."""
    if architecture not in _REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    module, name = _REGISTRY[architecture]
    return getattr(importlib.import_module(module), name)
