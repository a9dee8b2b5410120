"""Where the embedded demo pair lives (``assets/demo/`` in the source tree).

``LAGUNA_DFLASH_DEMO_DIR`` overrides the location.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def demo_dir() -> Path:
    env = os.environ.get("LAGUNA_DFLASH_DEMO_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "assets" / "demo"


def demo_pair() -> tuple[str, str]:
    """(target dir, draft dir) of the embedded pair; a clear error if it is not installed."""
    root = demo_dir()
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise ValueError(
            f"no --model given and the embedded demo pair is not at {root}; pass --model DIR "
            "(and --draft DIR), or set LAGUNA_DFLASH_DEMO_DIR"
        )
    return str(target), str(draft)


def heldout_prompts() -> list[str]:
    """The held-out evaluation prompts shipped with the demo pair."""
    path = demo_dir() / "heldout_prompts.json"
    if not path.is_file():
        raise ValueError(f"{path} not found; pass --prompts FILE")
    return json.loads(path.read_text())
