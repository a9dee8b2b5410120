"""``serve`` exits (code 1) when its engine loop dies, instead of answering 503 forever; it
still exits 0 when stopped normally, and it freezes its start-up heap for the garbage collector
before serving. Runs ``launcher.serve`` in a thread on a random tiny pair."""

from __future__ import annotations

import gc
import logging
import threading
import time

import httpx
import pytest

from laguna_dflash.cli import build_parser
from laguna_dflash.models.random_init import write_random_pair
from laguna_dflash.server import launcher
from laguna_dflash.server.args import resolve_server_config
from laguna_dflash.server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    target, _ = write_random_pair(tmp_path_factory.mktemp("death"), seed=5)
    args = build_parser().parse_args(["serve", "--model", str(target), "--port", "0",
                                      "--max-model-len", "64", "--log-level", "warning"])
    return resolve_server_config(args)


@pytest.fixture(autouse=True)
def _unfreeze():
    # serve() freezes the heap of the process it runs in: give the test process its heap back
    yield
    gc.unfreeze()


def _serve_in_thread(config) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", launcher.serve(config, 0.05)),
                              daemon=True)
    thread.start()
    return thread, result


def test_serve_exits_1_when_the_engine_loop_dies(config, monkeypatch, caplog):
    def die(self):
        raise RuntimeError("simulated engine crash")

    monkeypatch.setattr(AsyncEngine, "_loop", die)
    caplog.set_level(logging.ERROR)
    thread, result = _serve_in_thread(config)
    thread.join(60)
    assert not thread.is_alive() and result["code"] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("engine loop died" in m for m in messages)
    assert any("shutting the server down" in m and "simulated engine crash" in m for m in messages)


def test_serve_exits_0_when_stopped(config, monkeypatch):
    gc.unfreeze()
    servers = []
    real_server = launcher.uvicorn.Server

    def recording_server(cfg):
        servers.append(real_server(cfg))
        return servers[-1]

    monkeypatch.setattr(launcher.uvicorn, "Server", recording_server)
    thread, result = _serve_in_thread(config)
    deadline = time.monotonic() + 60
    while not (servers and servers[0].started) and time.monotonic() < deadline:
        time.sleep(0.05)
    port = servers[0].servers[0].sockets[0].getsockname()[1]
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    assert gc.get_freeze_count() > 10_000  # the start-up heap (modules, the engine), frozen
    time.sleep(0.2)  # a few watchdog rounds on a live engine: it must not stop the server
    assert thread.is_alive()
    servers[0].should_exit = True
    thread.join(30)
    assert not thread.is_alive() and result["code"] == 0
