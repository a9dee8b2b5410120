"""``--device``: "cuda" resolves to an indexed device, and the server's engine thread selects it.

The GPU itself is not needed: ``torch.cuda``'s queries and ``set_device`` are monkeypatched, so
these run on the CPU. (On the H200 ``serve --device cuda`` used to die in the engine thread:
``torch.cuda.set_device`` refuses a CUDA device without an index; ``serve_smoke_xs.py``.)
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from laguna_dflash.config import EngineConfig, resolve_device
from laguna_dflash.engine.engine import LLMEngine
from laguna_dflash.models.random_init import write_random_pair
from laguna_dflash.server.async_engine import AsyncEngine
from laguna_dflash.server.metrics import ServerMetrics


def _fake_cuda(monkeypatch, count: int = 2, current: int = 1) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_cuda_without_index_is_the_current_device(monkeypatch):
    _fake_cuda(monkeypatch)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_bad_cuda_devices_name_the_fix(monkeypatch):
    _fake_cuda(monkeypatch, count=1, current=0)
    with pytest.raises(ValueError, match=r"'cuda:3'.*1 CUDA device.*cuda:0 \.\. cuda:0"):
        resolve_device("cuda:3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available; use --device cpu"):
        resolve_device("cuda")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    target, _ = write_random_pair(tmp_path_factory.mktemp("dev"), seed=3)
    return LLMEngine(EngineConfig(model=str(target)))


def _run_engine_thread(engine: LLMEngine) -> AsyncEngine:
    loop = AsyncEngine(engine, ServerMetrics("m"))
    loop.start()
    deadline = time.monotonic() + 10
    while loop._thread.is_alive() and time.monotonic() < deadline and loop.fatal_error is None:
        time.sleep(0.05)
        if loop.is_alive:
            break
    return loop


def test_engine_thread_selects_the_indexed_device(engine, monkeypatch):
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(engine, "device", torch.device("cuda", 0))  # as resolve_device gives it
    loop = _run_engine_thread(engine)
    assert loop.is_alive
    loop.shutdown()
    assert selected == [torch.device("cuda", 0)]


def test_engine_thread_failing_to_select_its_device_is_recorded(engine, monkeypatch, caplog):
    def refuse(device):
        raise ValueError(f"Expected a torch.device with a specified index, but got:{device}")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    monkeypatch.setattr(engine, "device", torch.device("cuda"))
    caplog.set_level(logging.ERROR, logger="laguna_dflash.server.async_engine")
    loop = _run_engine_thread(engine)
    loop._thread.join(10)
    assert isinstance(loop.fatal_error, ValueError) and not loop.is_alive  # /health answers 503
    assert any("engine loop died" in r.getMessage() for r in caplog.records)
    loop.shutdown()
