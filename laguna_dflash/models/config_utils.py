"""Small helpers for reading HF ``config.json`` dicts with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ConfigReader:
    """Typed access to a config dict; a missing or malformed field names itself and the fix."""

    def __init__(self, cfg: dict, architecture: str) -> None:
        self.cfg = cfg
        self.architecture = architecture

    def int(self, key: str, default: Any = ...) -> int:
        value = self.cfg.get(key, default)
        if value is ... or value is None:
            if default is ...:
                raise ValueError(
                    f"config.json for {self.architecture} lacks required field {key!r}; add it"
                )
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ValueError(
                f"config.json field {key!r} must be an integer, got {value!r} ({type(value).__name__})"
            )
        return int(value)

    def float(self, key: str, default: Any = ...) -> float:
        value = self.cfg.get(key, default)
        if value is ... or value is None:
            if default is ...:
                raise ValueError(f"config.json for {self.architecture} lacks required field {key!r}; add it")
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config.json field {key!r} must be a number, got {value!r} ({type(value).__name__})")
        return float(value)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"config.json field {key!r} must be true or false, got {value!r} ({type(value).__name__})")
        return value

    def positive_int(self, key: str, default: Any = ...) -> int:
        value = self.int(key, default)
        if value <= 0:
            raise ValueError(f"config.json field {key!r} must be > 0, got {value}")
        return value

    def optional_int(self, key: str) -> int | None:
        return None if self.cfg.get(key) is None else self.positive_int(key)

    def check_len(self, key: str, values: list, expected: int) -> None:
        if not isinstance(values, list) or len(values) != expected:
            raise ValueError(
                f"config.json field {key!r} must be a list of num_hidden_layers={expected} entries, "
                f"got {values!r}"
            )


def eos_ids(cfg: dict, file: str = "config.json") -> tuple[int, ...]:
    """``eos_token_id`` of ``cfg`` (read from ``file``) as a tuple (an int, a list or absent)."""
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in ids):
        raise ValueError(f"{file} field 'eos_token_id' must be a token id or a list of token ids "
                         f"(ints >= 0), got {eos!r}")
    return tuple(ids)


def with_generation_eos_ids(model_dir: str | Path, eos: tuple[int, ...]) -> tuple[int, ...]:
    """``eos`` and then the ``eos_token_id`` of ``model_dir/generation_config.json`` not in it.
    Instruct checkpoints list their end-of-turn token there only (Qwen3's ``<|im_end|>`` beside
    ``<|endoftext|>``), and transformers' ``generate`` and vLLM stop on both. A missing or
    unreadable file adds nothing."""
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return eos
    extra = eos_ids(data, str(path)) if isinstance(data, dict) else ()
    return eos + tuple(dict.fromkeys(e for e in extra if e not in eos))
