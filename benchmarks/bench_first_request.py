"""What a request pays the first time its shapes are seen: one-time work after the engine's warm-up.

A fresh engine on the XS-2.1 pair (dummy weights, DFlash K = 3 unless ``--k 0``) serves a list of
scenarios in order, each twice: FIRST (its shapes new to the engine: CUDA graph captures for a
new padded batch size or key-length bucket, Triton builds for new prefill shapes) and REPEAT
(the same requests again, everything built). Per run: wall seconds, the first step (the
prefill: time to first token), the longest later step (a stall a streaming client sees between
tokens), and the CUDA graphs captured during it. The engine's start-up is timed too, by phase
(load, warm-up, start-up capture), with the Triton compiles it ran and their seconds by kernel. With ``--cold`` the Triton and inductor caches start empty (a fresh install); without it
they are whatever the machine has.

    python benchmarks/bench_first_request.py --cold                    # H200, default kernels
    python benchmarks/bench_first_request.py --cold --batch-invariant
    python benchmarks/bench_first_request.py --device cpu --layers 2 --hidden 256 \
        --scenarios 1x40x8,2x20x8 --max-model-len 128 --max-num-seqs 4   # CPU wiring check
    python benchmarks/bench_first_request.py --scenarios 1x100x8 \
        --switch laguna_dflash.engine.cuda_graph:num_capture_warmups=2 \
        --switch laguna_dflash.engine.cuda_graph:keep_cache_between_captures=false  # old capture
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path


def parse_scenarios(text: str) -> list[tuple[int, int, int]]:
    """``"BxPxN,..."`` -> [(batch, prompt tokens, new tokens)]."""
    out = []
    for item in text.split(","):
        try:
            b, p, n = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--scenarios: {item!r} is not BATCHxPROMPTxNEW (e.g. 4x1000x64)") from None
        out.append((b, p, n))
    return out


def num_graphs(engine) -> int:
    """CUDA graphs captured so far by the target's, the drafter's and the context runners."""
    runners = [engine.runner] + ([engine.proposer.runner] if engine.proposer is not None else [])
    total = sum(len(r.graphs.graphs) for r in runners if r.graphs is not None)
    ctx = getattr(engine.proposer, "context_graphs", None) if engine.proposer is not None else None
    return total + (len(ctx.graphs) if ctx is not None else 0)


class CompileLog:
    """Counts Triton kernel compiles (by kernel name, through Triton's pre- and post-compile
    hooks) with the seconds each took, and ``torch.compile`` frames compiled, since
    :meth:`reset`. A "compile" is a kernel variant new to this process: with a warm on-disk
    cache it is a load (fast), with an empty one a build. A compile submitted to the builds-ahead
    pool (Triton's ``AsyncCompileMode``, kernels/precompile.py) is counted in ``pooled`` and not
    timed: its post-compile hook runs when the pool's scope ends, so the span from its submission
    would be the rest of that scope (the phase's "built ahead" seconds time the pool instead)."""

    def __init__(self) -> None:
        from collections import Counter

        import torch._dynamo.utils
        import triton
        from triton.runtime import _async_compile

        self._frames = torch._dynamo.utils.counters["frames"]
        self._dynamo_seconds = torch._dynamo.utils.compilation_time_metrics
        self.builds: Counter = Counter()
        self.seconds: Counter = Counter()
        self.pooled: Counter = Counter()  # of builds, those submitted to the builds-ahead pool
        self.total_seconds = 0.0  # every compile's, never reset (start-up phases take differences)
        self._base = 0
        started: dict = {}

        def before(*, key, **_):
            started[key] = (time.perf_counter(), _async_compile.active_mode.get() is not None)
            return False  # falsy: compile (a true value would skip the kernel)

        def after(*, key, fn, **_):
            name = fn.name.rsplit(".", 1)[-1]
            t0, is_pooled = started.pop(key, (time.perf_counter(), False))
            self.builds[name] += 1
            if is_pooled:
                self.pooled[name] += 1
                return
            seconds = time.perf_counter() - t0
            self.seconds[name] += seconds
            self.total_seconds += seconds

        triton.knobs.runtime.jit_cache_hook = before
        triton.knobs.runtime.jit_post_compile_hook = after

    def reset(self) -> None:
        self.builds.clear()
        self.seconds.clear()
        self.pooled.clear()
        self._base = self._frames["ok"]

    @property
    def num_frames(self) -> int:
        return self._frames["ok"] - self._base

    @property
    def torch_compile_seconds(self) -> float:
        """Seconds spent in ``torch.compile`` (dynamo + inductor) so far in this process."""
        return sum(self._dynamo_seconds.get("_compile.compile_inner", ()))


class StartupPhases:
    """Times the engine's start-up phases (``LLMEngine.warmup`` and its
    ``capture_all_graphs``) by wrapping the class's methods while it is built; with a
    :class:`CompileLog`, also the Triton and ``torch.compile`` seconds inside each phase
    (``compile_seconds[phase] = (triton, torch.compile)``)."""

    def __init__(self, compiles: CompileLog | None = None) -> None:
        # capture includes "build ahead"; "first use" (the builds of captures made on first use:
        # the warm-up's batch-1 graphs, lazy capture) is inside the phase or step it ran in
        # "eager batches": the warm-up's batches above --cuda-graph-max-bs (inside "warm-up")
        self.seconds = {"warm-up": 0.0, "capture": 0.0, "build ahead": 0.0, "first use": 0.0,
                        "eager batches": 0.0}
        self.num_built_ahead = 0
        self.num_built_first_use = 0  # variants, over the whole run
        self.num_first_use = 0  # captures made on first use that built ahead
        self.compile_seconds = {"warm-up": (0.0, 0.0), "capture": (0.0, 0.0)}
        self._compiles = compiles

    def _compile_totals(self) -> tuple[float, float]:
        c = self._compiles
        return (c.total_seconds, c.torch_compile_seconds) if c is not None else (0.0, 0.0)

    def _add_compiles(self, phase: str, before: tuple[float, float], minus: tuple[float, float] = (0.0, 0.0)) -> None:
        now = self._compile_totals()
        self.compile_seconds[phase] = tuple(
            old + n - b - m for old, n, b, m in zip(self.compile_seconds[phase], now, before, minus))

    def wrap(self, engine_cls):
        import contextlib

        phases = self

        @contextlib.contextmanager
        def patched():
            saved = engine_cls.warmup, engine_cls.capture_all_graphs
            saved_eager = getattr(engine_cls, "_warmup_eager_batches", None)

            def warmup_eager_batches(engine, *args, **kwargs):
                t = time.perf_counter()
                try:
                    return saved_eager(engine, *args, **kwargs)
                finally:
                    phases.seconds["eager batches"] += time.perf_counter() - t

            def warmup(engine):
                t, c = time.perf_counter(), phases._compile_totals()
                capture_s, capture_c = phases.seconds["capture"], phases.compile_seconds["capture"]
                try:
                    return saved[0](engine)
                finally:  # includes the capture it calls last
                    phases.seconds["warm-up"] += (time.perf_counter() - t
                                                  - (phases.seconds["capture"] - capture_s))
                    grown = tuple(a - b for a, b in zip(phases.compile_seconds["capture"], capture_c))
                    phases._add_compiles("warm-up", c, grown)

            def capture_all_graphs(engine):
                t, c = time.perf_counter(), phases._compile_totals()
                try:
                    return saved[1](engine)
                finally:
                    phases.seconds["capture"] += time.perf_counter() - t
                    phases._add_compiles("capture", c)

            module = sys.modules[engine_cls.__module__]
            build = getattr(module, "build_kernels_ahead", None)
            graphs_module = importlib.import_module("laguna_dflash.engine.cuda_graph")
            first_use_build = graphs_module.build_kernels_ahead

            def build_first_use(*args, **kwargs):  # a capture on first use (capture_graph)
                t = time.perf_counter()
                try:
                    built = first_use_build(*args, **kwargs)
                    phases.num_built_first_use += built
                    phases.num_first_use += 1
                    return built
                finally:
                    phases.seconds["first use"] += time.perf_counter() - t

            def build_kernels_ahead(*args, **kwargs):  # inside the capture phase
                t = time.perf_counter()
                try:
                    built = build(*args, **kwargs)
                    phases.num_built_ahead += built
                    return built
                finally:
                    phases.seconds["build ahead"] += time.perf_counter() - t

            engine_cls.warmup, engine_cls.capture_all_graphs = warmup, capture_all_graphs
            if saved_eager is not None:
                engine_cls._warmup_eager_batches = warmup_eager_batches
            if build is not None:
                module.build_kernels_ahead = build_kernels_ahead
            graphs_module.build_kernels_ahead = build_first_use
            try:
                yield phases
            finally:
                engine_cls.warmup, engine_cls.capture_all_graphs = saved
                if saved_eager is not None:
                    engine_cls._warmup_eager_batches = saved_eager
                if build is not None:
                    module.build_kernels_ahead = build
                graphs_module.build_kernels_ahead = first_use_build

        return patched()


class GcClock:
    """Inside ``with``: the seconds and number of garbage collections (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.count += 1

    def __enter__(self) -> GcClock:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._callback)


class StepClock:
    """Wraps ``engine.step``: the wall time of every step since :meth:`reset`, and with
    ``num_builds`` (a count of Triton compiles so far) the compiles inside decode steps (those
    that advance ``engine.timings.num_decode_steps``; prefill steps' are not counted)."""

    def __init__(self, engine, sync, num_builds=None) -> None:
        self.steps: list[float] = []
        self.num_decode_builds = 0
        inner = engine.step

        def timed():
            builds = num_builds() if num_builds is not None else 0
            decodes = engine.timings.num_decode_steps
            t0 = time.perf_counter()
            out = inner()
            sync()
            self.steps.append(time.perf_counter() - t0)
            if num_builds is not None and engine.timings.num_decode_steps > decodes:
                self.num_decode_builds += num_builds() - builds
            return out

        engine.step = timed

    def reset(self) -> None:
        self.steps = []
        self.num_decode_builds = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scenarios", default="1x1000x64,4x1000x64,16x300x32,1x3000x32,8x50x32,1x12x32,3x25x32,1x150x32",
                    help="BATCHxPROMPTxNEW, comma separated, run in this order")
    ap.add_argument("--k", type=int, default=3, help="draft tokens (0: target-only)")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU wiring check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-model-len", type=int, default=4000)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--cold", action="store_true", help="empty Triton and inductor caches")
    ap.add_argument("--no-build-ahead", action="store_true",
                    help="start-up capture builds each Triton kernel when first launched "
                         "(engine.cuda_graph.build_ahead = False)")
    ap.add_argument("--no-moe-build-ahead", action="store_true",
                    help="start-up does not build the sorted MoE kernels of every tile height "
                         "(layers.build_sorted_moe_kernels_ahead): a first long eager prefill does")
    ap.add_argument("--switch", action="append", default=[],
                    help="module:attr=value set before the engine is built (repeatable), e.g. "
                         "laguna_dflash.engine.cuda_graph:num_capture_warmups=2")
    ap.add_argument("--option", action="append", default=[],
                    help="extra LLM keyword, NAME=VALUE (int, float, true/false or text); repeatable")
    args = ap.parse_args()
    scenarios = parse_scenarios(args.scenarios)
    with tempfile.TemporaryDirectory() as tmp:
        if args.cold:  # before triton / inductor are imported
            os.environ["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        run(args, scenarios, Path(tmp))


def option_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def run(args: argparse.Namespace, scenarios: list[tuple[int, int, int]], tmp: Path) -> None:
    import torch
    from bench_gpu_xs import parse_switch, sync, write_xs_configs, xs_pair_llm

    from laguna_dflash import LLM, SamplingParams
    from laguna_dflash.engine import cuda_graph
    from laguna_dflash.engine.engine import LLMEngine
    from laguna_dflash.engine.kv_cache import KVCache

    cuda_graph.build_ahead = not args.no_build_ahead
    for text in args.switch:
        obj, name, value = parse_switch(text)
        setattr(obj, name, value)

    # no prefix caching: every request's prefill is timed whole (the prompts repeat)
    options = dict(batch_invariant=args.batch_invariant, cuda_graph_capture="startup",
                   enable_prefix_caching=False)
    for item in args.option:
        name, _, value = item.partition("=")
        options[name] = option_value(value)
    from laguna_dflash.engine import engine as engine_module
    profile_s = []  # --option gpu_memory_utilization=U: the start-up profile run's seconds
    profile = engine_module.activation_peak_bytes

    def timed_profile(*a, **kw):
        t = time.perf_counter()
        try:
            return profile(*a, **kw)
        finally:
            profile_s.append(time.perf_counter() - t)

    engine_module.activation_peak_bytes = timed_profile
    moe_ahead = []  # (variants submitted, seconds) of the sorted MoE kernels' build at start-up
    build_moe = engine_module.build_sorted_moe_kernels_ahead

    def timed_moe_build(model):
        t = time.perf_counter()
        n = 0 if args.no_moe_build_ahead else build_moe(model)
        moe_ahead.append((n, time.perf_counter() - t))
        return n

    engine_module.build_sorted_moe_kernels_ahead = timed_moe_build
    compiles = CompileLog()  # before the engine: its start-up compiles count too
    gc_clock = GcClock()
    t0 = time.perf_counter()
    with StartupPhases(compiles).wrap(LLMEngine) as phases, gc_clock:
        if args.k:
            llm, tcfg = xs_pair_llm(args, tmp, args.max_model_len, args.max_num_seqs,
                                    num_speculative_tokens=args.k, **options)
        else:  # target-only: no drafter loaded, so the warm-up builds what target-only steps use
            tdir, _, tcfg = write_xs_configs(tmp, args.layers, args.hidden)
            dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
            llm = LLM(str(tdir), dtype=dtype, device=args.device, load_format="dummy",
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, **options)
    startup_s = time.perf_counter() - t0
    startup_builds, startup_build_s = dict(compiles.builds), dict(compiles.seconds)
    startup_pooled_by = dict(compiles.pooled)
    startup_pooled = sum(startup_pooled_by.values())
    engine = llm.engine
    warm_graphs = num_graphs(engine)
    startup_gib = torch.cuda.memory_reserved() / 2**30 if args.device.startswith("cuda") else None
    if startup_gib is not None:  # start-up's peaks, then the scenarios' own
        startup_peak_gib = (torch.cuda.max_memory_reserved() / 2**30,
                            torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(engine, lambda: sync(args.device), lambda: sum(compiles.builds.values()))
    rng = random.Random(0)
    rows = []
    for batch, prompt_len, new_tokens in scenarios:
        if prompt_len + new_tokens + args.k + 1 > args.max_model_len:
            raise SystemExit(f"scenario {batch}x{prompt_len}x{new_tokens} exceeds --max-model-len")
        prompts = [[rng.randrange(100, tcfg["vocab_size"] - 1) for _ in range(prompt_len)]
                   for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for label in ("first", "repeat"):
            graphs = num_graphs(engine)
            clock.reset()
            compiles.reset()
            t = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - t
            steps = clock.steps
            rows.append((f"{batch}x{prompt_len}x{new_tokens}", label, wall, steps[0],
                         max(steps[1:], default=0.0), sorted(steps[1:])[len(steps[1:]) // 2] if len(steps) > 1 else 0.0,
                         num_graphs(engine) - graphs, sum(compiles.builds.values()),
                         clock.num_decode_builds, compiles.num_frames, dict(compiles.builds)))
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{gpu}, layers {args.layers}, K {args.k}, batch-invariant {args.batch_invariant}, "
          f"cold caches {args.cold}, max_model_len {args.max_model_len}, max_num_seqs "
          f"{args.max_num_seqs}, options {options}, build ahead {cuda_graph.build_ahead}")
    mem = f", {startup_gib:.1f} GiB reserved by torch after it" if startup_gib is not None else ""
    print(f"engine start-up (load + warm-up): {startup_s:.1f} s; {warm_graphs} CUDA graphs after it{mem}")
    warm, capture = phases.seconds["warm-up"], phases.seconds["capture"]
    print(f"start-up phases: load {startup_s - warm - capture:.1f} s, warm-up {warm:.1f} s "
          f"(eager batches above --cuda-graph-max-bs {phases.seconds['eager batches']:.1f} s), "
          f"start-up capture {capture:.1f} s (of which {phases.num_built_ahead} kernel variants "
          f"built ahead in {phases.seconds['build ahead']:.1f} s); {phases.num_first_use} captures on first "
          f"use built {phases.num_built_first_use} variants ahead in {phases.seconds['first use']:.1f} s; "
          f"Triton compiles {sum(startup_builds.values())}, {startup_pooled} of them through the "
          f"builds-ahead pool (timed as that pool only); the others took "
          f"{sum(startup_build_s.values()):.1f} s")
    print(f"sorted MoE kernels built ahead: {sum(n for n, _ in moe_ahead)} variants in "
          f"{sum(t for _, t in moe_ahead):.1f} s" + (" (off: --no-moe-build-ahead)" if args.no_moe_build_ahead else ""))
    print("compile seconds inside each phase (Triton, torch.compile): " + ", ".join(
        f"{name} {tri:.1f} / {tc:.1f}" for name, (tri, tc) in phases.compile_seconds.items())
        + f"; garbage collection during start-up: {gc_clock.seconds:.1f} s in {gc_clock.count} runs")
    slowest = sorted(startup_builds, key=lambda k: (-startup_build_s.get(k, 0.0), -startup_builds[k]))[:8]
    if slowest:
        print("start-up Triton compiles by kernel (count, of them pooled, seconds of the others): "
              + ", ".join(f"{k} x{startup_builds[k]} ({startup_pooled_by.get(k, 0)}) "
                          f"{startup_build_s.get(k, 0.0):.1f} s" for k in slowest))
    if args.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        kv_gib = KVCache.num_bytes(engine.runner.kv_cache,
                                   *([engine.proposer.kv_cache] if engine.proposer else [])) / 2**30
        print(f"KV cache {engine.allocator.num_blocks} blocks ({kv_gib:.1f} GiB); profiled activation "
              f"peak {engine.profiled_activation_bytes / 2**30:.2f} GiB"
              + (f" in {sum(profile_s):.1f} s" if profile_s else " (no profile run)")
              + f"; torch's peak reserved (allocated) GiB: start-up {startup_peak_gib[0]:.1f} "
              f"({startup_peak_gib[1]:.1f}), the scenarios {torch.cuda.max_memory_reserved() / 2**30:.1f}"
              f" ({torch.cuda.max_memory_allocated() / 2**30:.1f}); device memory in use at the end {(total - free) / 2**30:.1f} of "
              f"{total / 2**30:.1f} GiB")
    print()
    print("| scenario (BxPxN) | run | wall s | first step ms | longest later step ms | "
          "median later step ms | graphs captured | Triton builds | of them in decode steps | "
          "torch.compile frames |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, label, wall, first, longest, median, captured, builds, decode_builds, frames, _ in rows:
        # longest and median at one precision: rounding keeps longest >= median only then
        print(f"| {name} | {label} | {wall:.3f} | {first * 1e3:.1f} | {longest * 1e3:.2f} | "
              f"{median * 1e3:.2f} | {captured} | {builds} | {decode_builds} | {frames} |")
    for name, label, *_, kernels in rows:
        if kernels:
            print(f"{name} {label}: Triton built " + ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items())))


if __name__ == "__main__":
    main()
