"""benchmarks/bench_first_request.py and benchmarks/profile_prefill_xs.py, CPU wiring runs:
one row per scenario and run, a malformed scenario an error naming ``--scenarios``; the prefill
profile prints its table of kernels (aten ops on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_first_request  # noqa: E402
import profile_prefill_xs  # noqa: E402

ARGS = ["bench_first_request.py", "--device", "cpu", "--layers", "2", "--hidden", "256",
        "--max-model-len", "128", "--max-num-seqs", "4", "--scenarios", "1x40x6,3x20x5"]


@pytest.mark.parametrize("k", ["3", "0"])
def test_cpu_wiring_prints_a_row_per_scenario_and_run(monkeypatch, capsys, k) -> None:
    monkeypatch.setattr(sys, "argv", ARGS + ["--k", k])
    bench_first_request.main()
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 1x40x6 |") or line.startswith("| 3x20x5 |")]
    assert [(r[0], r[1]) for r in rows] == [("1x40x6", "first"), ("1x40x6", "repeat"),
                                            ("3x20x5", "first"), ("3x20x5", "repeat")]
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) >= float(r[5]) > 0
        assert r[6] == "0"  # no CUDA graphs on the CPU
    assert f"K {k}," in out


def test_a_malformed_scenario_names_the_flag(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ARGS[:-1] + ["4x1000"])
    with pytest.raises(SystemExit, match="--scenarios"):
        bench_first_request.main()


def test_a_scenario_past_the_model_length_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ARGS[:-1] + ["1x120x20"])
    with pytest.raises(SystemExit, match="--max-model-len"):
        bench_first_request.main()


def test_prefill_profile_prints_its_kernels(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["profile_prefill_xs.py", "--device", "cpu", "--layers", "2",
                                      "--hidden", "256", "--context", "48", "--modes", "default",
                                      "--top", "4"])
    profile_prefill_xs.main()
    out = capsys.readouterr().out
    assert "default: prefill of 48 tokens" in out
    rows = [line for line in out.splitlines() if line.startswith("| aten::")]
    assert len(rows) == 4
    assert all(float(r.split("|")[2]) >= 0 for r in rows)


def test_startup_phases_split_the_warmup_from_its_capture() -> None:
    """The warm-up's time excludes the start-up capture it calls last; the class is restored."""
    import time

    class Engine:
        def warmup(self):
            time.sleep(0.05)
            self.capture_all_graphs()

        def capture_all_graphs(self):
            time.sleep(0.1)
            return 7

    original = Engine.warmup
    with bench_first_request.StartupPhases().wrap(Engine) as phases:
        Engine().warmup()
    assert Engine.warmup is original
    assert 0.1 <= phases.seconds["capture"] < 0.2 and 0.05 <= phases.seconds["warm-up"] < 0.1


def test_startup_phases_attribute_compile_seconds_to_their_phase() -> None:
    """Compile seconds spent inside the capture count for the capture only, the rest of the
    warm-up's for the warm-up; Triton's and torch.compile's apart."""

    class Compiles:
        total_seconds = 0.0
        torch_compile_seconds = 0.0

    compiles = Compiles()

    class Engine:
        def warmup(self):
            compiles.total_seconds += 2.0
            compiles.torch_compile_seconds += 5.0
            self.capture_all_graphs()
            compiles.total_seconds += 1.0

        def capture_all_graphs(self):
            compiles.total_seconds += 10.0
            compiles.torch_compile_seconds += 0.5

    with bench_first_request.StartupPhases(compiles).wrap(Engine) as phases:
        Engine().warmup()
    assert phases.compile_seconds == {"warm-up": (3.0, 5.0), "capture": (10.0, 0.5)}


def test_startup_phases_time_the_builds_ahead_inside_the_capture(monkeypatch) -> None:
    import time
    import types

    module = types.ModuleType("fake_engine_module")

    def build_kernels_ahead(forwards, device):
        time.sleep(0.05)
        return len(forwards)

    module.build_kernels_ahead = build_kernels_ahead

    class Engine:
        def warmup(self):
            self.capture_all_graphs()

        def capture_all_graphs(self):
            module.build_kernels_ahead([1, 2, 3], "cuda")
            time.sleep(0.05)

    Engine.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with bench_first_request.StartupPhases().wrap(Engine) as phases:
        Engine().warmup()
    assert module.build_kernels_ahead is build_kernels_ahead
    assert phases.num_built_ahead == 3
    assert 0.05 <= phases.seconds["build ahead"] < phases.seconds["capture"] < 0.2


def test_gc_clock_times_collections_inside_its_scope() -> None:
    import gc

    with bench_first_request.GcClock() as clock:
        gc.collect()
        gc.collect()
    gc.collect()
    assert clock.count == 2 and clock.seconds > 0


def test_step_clock_counts_the_builds_of_decode_steps_only() -> None:
    """A prefill step's builds are left out of ``num_decode_builds``; a decode step's counted;
    :meth:`reset` clears them with the step times."""
    from types import SimpleNamespace

    builds = [0]
    engine = SimpleNamespace(timings=SimpleNamespace(num_decode_steps=0))
    kinds = iter(["prefill", "decode", "decode", "prefill"])

    def step():
        kind = next(kinds)
        builds[0] += {"prefill": 5, "decode": 2}[kind]
        engine.timings.num_decode_steps += kind == "decode"

    engine.step = step
    clock = bench_first_request.StepClock(engine, lambda: None, lambda: builds[0])
    for _ in range(3):
        engine.step()
    assert clock.num_decode_builds == 4 and len(clock.steps) == 3
    clock.reset()
    engine.step()
    assert clock.num_decode_builds == 0 and clock.steps and len(clock.steps) == 1


def test_compile_log_counts_and_times_compiles_by_kernel() -> None:
    pytest.importorskip("triton")
    import triton

    saved = triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook
    try:
        log = bench_first_request.CompileLog()

        class Fn:
            name = "laguna_dflash.kernels.fused_moe._down_kernel"

        for key in ("a", "b"):  # the two hooks Triton calls around a compile
            assert not triton.knobs.runtime.jit_cache_hook(key=key, fn=Fn)  # falsy: do compile
            triton.knobs.runtime.jit_post_compile_hook(key=key, fn=Fn)
        assert log.builds == {"_down_kernel": 2} and log.seconds["_down_kernel"] >= 0
        assert log.total_seconds == log.seconds["_down_kernel"]
        assert log.torch_compile_seconds >= 0
        log.reset()
        assert not log.builds and not log.seconds
    finally:
        triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = saved


def test_startup_phases_count_the_first_use_builds(monkeypatch) -> None:
    """Builds ahead of a capture made on first use (``cuda_graph.capture_graph`` during the
    warm-up) are counted apart from start-up's pass, and the module is restored."""
    import time

    from laguna_dflash.engine import cuda_graph

    def build_kernels_ahead(forwards, device):
        time.sleep(0.02)
        return 4 * len(forwards)

    monkeypatch.setattr(cuda_graph, "build_kernels_ahead", build_kernels_ahead)

    class Engine:
        def warmup(self):
            for _ in range(3):  # three batch-1 graphs captured on first use
                cuda_graph.build_kernels_ahead([object()], "cuda")

        def capture_all_graphs(self):
            return 0

    with bench_first_request.StartupPhases().wrap(Engine) as phases:
        Engine().warmup()
    assert cuda_graph.build_kernels_ahead is build_kernels_ahead
    assert (phases.num_first_use, phases.num_built_first_use, phases.num_built_ahead) == (3, 12, 0)
    assert 0.06 <= phases.seconds["first use"] < 0.5


def test_compile_log_counts_pooled_builds_without_timing_them(monkeypatch) -> None:
    """A compile submitted inside Triton's AsyncCompileMode (the builds-ahead pool) is counted as
    pooled and adds no seconds (its post-compile hook runs when the pool's scope ends); one
    outside it is timed from its pre- to its post-compile hook."""
    import time
    import types
    from concurrent.futures import ThreadPoolExecutor

    import triton
    from triton.runtime._async_compile import AsyncCompileMode

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    log = bench_first_request.CompileLog()
    before, after = triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook
    fn = types.SimpleNamespace(name="pkg.module._some_kernel")
    with ThreadPoolExecutor(1) as pool, AsyncCompileMode(pool):
        before(key="pooled", fn=fn)
    time.sleep(0.02)
    after(key="pooled", fn=fn)  # as the scope's end finalizes it
    assert log.builds["_some_kernel"] == log.pooled["_some_kernel"] == 1
    assert log.seconds["_some_kernel"] == 0.0 and log.total_seconds == 0.0
    before(key="plain", fn=fn)
    time.sleep(0.02)
    after(key="plain", fn=fn)
    assert log.builds["_some_kernel"] == 2 and log.pooled["_some_kernel"] == 1
    assert log.seconds["_some_kernel"] >= 0.015 and log.total_seconds == log.seconds["_some_kernel"]
    log.reset()
    assert not log.builds and not log.pooled
