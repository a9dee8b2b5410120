"""Shared test setup: one torch thread (the tiny models thrash with more), fixture paths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")
