"""Shared test setup: one torch thread (the tiny models thrash with more), fixture paths, RoPE
tables exactly as long as asked for, a short engine warm-up (below), and ``--switch
module:attr=value`` to run the tests with a candidate setting."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--switch", action="append", default=[], metavar="MODULE:ATTR=VALUE",
        help="set a module attribute for the whole run, as the benchmarks' --switch does (value as "
             "JSON; repeatable), e.g. --switch laguna_dflash.kernels.staged_gemv:ONE_ROW_CONFIG=[8,512,12,4]: "
             "a GPU run tests a candidate setting before it becomes the default")


def pytest_configure(config: pytest.Config) -> None:
    """Apply ``--switch`` settings (restored at the end of the run); each xdist worker applies
    them too, as it configures."""
    texts = config.getoption("switch", default=[]) or []
    if not texts:
        return
    sys.path.append(str(REPO / "benchmarks"))  # after tests/: a benchmark module shadows no test helper
    from bench_gpu_xs import parse_switch, switch_error

    errors = [e for e in map(switch_error, texts) if e is not None]
    if errors:
        raise pytest.UsageError("--switch: " + "; ".join(errors))
    saved = []
    for text in texts:
        obj, name, value = parse_switch(text)
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
    config.stash[_SAVED_SWITCHES] = saved


def pytest_unconfigure(config: pytest.Config) -> None:
    for obj, name, value in reversed(config.stash.get(_SAVED_SWITCHES, [])):
        setattr(obj, name, value)


def pytest_report_header(config: pytest.Config) -> list[str]:
    texts = config.getoption("switch", default=[]) or []
    return [f"switches: {'; '.join(texts)}"] if texts else []


_SAVED_SWITCHES = pytest.StashKey[list]()

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter children (interpreter_child.py)
    import interpreter_bounds
    import interpreter_speedup

    interpreter_speedup.install()
    interpreter_bounds.install()


def skip_graph_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a CUDA graph capture skip the test that starts it (see the fixture below)."""

    def skip_capture(self: object, *args: object, **kwargs: object) -> None:
        pytest.skip("CUDA graph capture needs torch's caching allocator "
                    "(unset PYTORCH_NO_CUDA_MEMORY_CACHING to run this part)")

    # torch.cuda.graph enters its side stream before capture_begin: skip before that
    monkeypatch.setattr(torch.cuda.graph, "__enter__", skip_capture)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", skip_capture)


@pytest.fixture(autouse=True)
def _no_capture_without_caching_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """With PYTORCH_NO_CUDA_MEMORY_CACHING=1 (``gpu_check.sh sanitize``: every tensor its own
    cudaMalloc, so compute-sanitizer sees an access past a tensor's end) a CUDA graph cannot be
    captured: its allocations would be cudaMallocs inside the capture, which invalidate it. A
    test skips where it starts one, after its eager checks ran under the sanitizer."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        skip_graph_captures(monkeypatch)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(autouse=True)
def _short_warmup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA engines warm up at construction (engine.LLMEngine.warmup); its prefills of
    WARMUP_PREFILL_LENGTHS build kernels for prompt shapes the tests never use, minutes on a GPU
    over a test run. They are skipped except in tests marked ``full_warmup``, which check them;
    the two decoding requests and the start-up graph captures still run everywhere."""
    if request.node.get_closest_marker("full_warmup") is None:
        from laguna_dflash.engine import engine

        monkeypatch.setattr(engine, "WARMUP_PREFILL_LENGTHS", ())


@pytest.fixture(autouse=True)
def _exact_rope_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """RoPE tables hold exactly the positions the engine asks for (not at least 256): a forward
    computing a position past them then fails on the CPU (an index error) instead of reading
    the table's slack; on CUDA such a read is out of bounds (the thirty-fifth pass's illegal
    address, which the CPU tests' short tables hid)."""
    from laguna_dflash.models import rope

    monkeypatch.setattr(rope, "MIN_TABLE_POSITIONS", 1)
