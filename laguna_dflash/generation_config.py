"""A checkpoint's ``generation_config.json`` as sampling defaults, as vLLM's ``generation_config``
option reads it: ``LLM(..., generation_config=)`` and ``serve --generation-config`` both take
theirs from :func:`sampling_defaults`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["SAMPLING_DEFAULT_KEYS", "sampling_defaults"]

#: ``generation_config.json`` keys vLLM takes as sampling defaults -> the ``SamplingParams``
#: field each gives a default for (``max_new_tokens`` is ``max_tokens``).
SAMPLING_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                         "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                         "max_new_tokens": "max_tokens"}


def _read(directory: str | Path) -> dict:
    """``SamplingParams`` field -> value for the keys ``directory/generation_config.json`` sets;
    ``{}`` without the file (an unreadable one is logged and ignored)."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    if not isinstance(data, dict):
        logger.warning("ignoring %s: not a JSON object", path)
        return {}
    return {field: data[key] for key, field in SAMPLING_DEFAULT_KEYS.items() if data.get(key) is not None}


def sampling_defaults(choice: str | Path, model: str | Path, name: str = "--generation-config") -> dict:
    """vLLM's ``generation_config`` choice: ``"auto"``, ``model``'s ``generation_config.json``;
    ``"vllm"`` / ``"none"``, no defaults; else a directory that must hold a
    ``generation_config.json`` (a ``ValueError`` naming ``name`` otherwise). Returns
    ``SamplingParams`` field -> value."""
    if choice == "auto":
        return _read(model)
    if choice in ("vllm", "none"):
        return {}
    if not isinstance(choice, (str, Path)) or not (Path(choice) / "generation_config.json").is_file():
        label = f"{name}{choice!r}" if name.endswith("=") else f"{name} {choice}"
        raise ValueError(f"{label}: no generation_config.json there; pass 'auto' (the "
                         "model's), 'vllm' or 'none' (no defaults), or a directory holding one")
    return _read(choice)
