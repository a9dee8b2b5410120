"""Where the GPU waits for the host in a decode step (Laguna-XS-2.1 size, one GPU; batch 1, and
the DFlash step's host path at other batch sizes with ``--gaps``).

The engine step takes longer than the GPU work it queues (fifth pass: 2.58 ms target-only
against a 2.30 ms graph replay; a K = 3 DFlash step 5.39 ms against 4.72 ms of synchronised
phases). This script finds where that time goes:

* step times (no profiler) of target-only decode and a K = 3 DFlash step, with the defaults and
  with each ``--switch`` (rows interleaved over ``--rounds``, graphs recaptured per row);
* a profile of a few steps with the engine's phases labelled (``record_function`` around
  ``Scheduler.schedule``, ``_commit``, the graph runners' host preparation, ``replay``,
  ``lm_head_logits``, sampling, ...): the GPU's idle gaps, each attributed to the innermost
  labelled phase the host was in (profiler overhead inflates host time, so read the shares, and
  take absolute step times from the first table);
* with ``--kernels N``: the N GPU kernels (and copies) of the profiled steps with the most time,
  per step, each marked as run inside a CUDA graph replay or launched eagerly (a kernel name
  seen when the captured graphs are replayed alone counts as a graph kernel);
* with ``--sequence``: per profiled mode, the GPU ops from the end of one graph replay to the
  start of the next, in order, with the GPU's idle time before each (the eager lm_head, the
  copies and uploads; a DFlash step lists its two such sequences);
* ``lm_head`` (100352 x 2048, 411 MB) at M = 1, 3, 4: ``F.linear`` (cuBLAS, what
  ``lm_head_logits`` calls) against the skinny GEMM, in a CUDA graph, weights rotated;
* with ``--gaps`` (``--gap-batches 1,16,64``): per DFlash step with drafts queued ahead, the
  host's time from the step's sync to the next verify's launch, and (CUDA events) the GPU's
  wait for that launch after the drafter block queued ahead. The block is all the GPU has
  queued while the host commits and schedules, so a host path longer than the block is idle
  GPU time; the host path grows with the batch (on the CPU the table has the host column only).
  The last column is the host's wall time in the verify graph's replay call, which the gap's
  event (recorded before the call) cannot see.
  After the table, the garbage collections that ran during each row's steps (count and longest
  pause a generation, from ``gc.callbacks``); ``--gc-freeze`` runs ``gc.collect(); gc.freeze()`` once
  the engine is built, as ``laguna-dflash serve`` does at start-up, so the start-up heap
  (modules, weights' Python objects, captured graphs) is no longer scanned. ``--gap-steps`` lists
  every step in order with the KV blocks the host allocated and the full blocks it offered the
  prefix cache (hashed and registered, or found cached) in its window: with equal prompt lengths a batch's requests cross block
  boundaries in the same steps, and on the CPU those windows took 1.5-1.8x the median at batch 64
  (docs/PERFORMANCE.md, sixty-eighth pass).

    python benchmarks/host_timeline.py                     # H200
    python benchmarks/host_timeline.py --switch laguna_dflash.engine.engine:store_context_in_verify=False
    python benchmarks/host_timeline.py --layers 4          # quicker, same phases
    python benchmarks/host_timeline.py --rounds 1 --sequence   # what runs between two replays
    python benchmarks/host_timeline.py --gaps --gap-batches 1,16,64 --rounds 1
    python benchmarks/host_timeline.py --gaps --gap-batches 64 --rounds 1 --gc-freeze
    python benchmarks/host_timeline.py --gaps --gap-batches 64 --rounds 1 --no-profile --gap-steps
    python benchmarks/host_timeline.py --device cpu --layers 2 --context 64 --gaps --gap-batches 1,16,64
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from bench_gpu_xs import parse_switch, step_time, sync, xs_draft_config, xs_target_config

from laguna_dflash import LLM
from laguna_dflash.config import DRAFT_QUANTIZATIONS
from laguna_dflash.engine import context_graph, cuda_graph, scheduler, spec_decode
from laguna_dflash.engine import engine as engine_mod
from laguna_dflash.engine.runner import HostCopy


def label(obj, attr: str, name: str) -> None:
    """Wrap ``obj.attr`` (a function or method) in ``record_function(name)``."""
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapped)


def install_labels(llm: LLM) -> None:
    engine = llm.engine
    label(scheduler.Scheduler, "schedule", "H schedule")
    label(engine_mod.LLMEngine, "_run", "H step")
    label(engine_mod.LLMEngine, "_commit", "H commit")
    label(engine_mod.LLMEngine, "_decode", "H decode")
    label(engine_mod.LLMEngine, "_spec_decode", "H spec_decode")
    label(engine_mod, "sample_rows", "H sample_rows")
    label(engine_mod, "accept_and_pack", "H accept_and_pack")
    label(spec_decode.DFlashProposer, "propose", "H propose")
    label(spec_decode.DFlashProposer, "store_context", "H store_context")
    label(context_graph.ContextGraphRunner, "run", "H context graph run")
    label(cuda_graph.CUDAGraphRunner, "forward", "H graph forward")
    label(torch.cuda.CUDAGraph, "replay", "H replay")
    label(engine.target, "lm_head_logits", "H target lm_head")
    if engine.drafter is not None:
        label(engine.drafter, "lm_head_logits", "H drafter lm_head")


def idle_by_phase(prof, min_gap_us: float = 2.0) -> tuple[Counter, Counter, float, float, int, Counter, Counter]:
    """(idle us per innermost host label, host us per label (inclusive), summed GPU busy us,
    window us, steps, GPU us per kernel name, launches per kernel name) of a profile (kernels:
    those starting inside the decode steps' host window; the GPU runs at most a step behind).

    GPU work = kernels and memcpys/memsets; gaps between them shorter than ``min_gap_us`` are
    counted as busy (launch spacing inside graphs)."""
    events = prof.events()
    gpu_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sorted((e.time_range.start, e.time_range.end) for e in gpu_events)
    ranges = [(e.time_range.start, e.time_range.end, e.name) for e in events
              if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("H ")]
    # decode steps only (a generate call starts with a prefill step)
    decodes = [r for r in ranges if r[2] in ("H decode", "H spec_decode")]
    steps = [r for r in ranges if r[2] == "H step" and any(r[0] <= d[0] < r[1] for d in decodes)]
    host = Counter()
    for s, e, name in ranges:
        if any(r[0] <= s < r[1] for r in steps):
            host[name] += e - s
    if not gpu or not steps:
        return Counter(), host, 0.0, 0.0, len(steps), Counter(), Counter()
    lo, hi = min(r[0] for r in steps), max(r[1] for r in steps)
    kernel_us, kernel_count = Counter(), Counter()
    for e in gpu_events:
        if lo <= e.time_range.start < hi and not e.name.startswith("H "):  # not the host labels' GPU echo
            kernel_us[e.name] += e.time_range.end - e.time_range.start
            kernel_count[e.name] += 1
    busy, gaps, cur = 0.0, [], None
    for s, e in gpu:
        if e <= lo or s >= hi:
            continue
        s, e = max(s, lo), min(e, hi)
        if cur is None:
            if s > lo:
                gaps.append((lo, s))
            cur = [s, e]
        elif s - cur[1] > min_gap_us:
            busy += cur[1] - cur[0]
            gaps.append((cur[1], s))
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        busy += cur[1] - cur[0]
        if cur[1] < hi:
            gaps.append((cur[1], hi))
    out = Counter()
    ranges.sort(key=lambda r: (r[0], -r[1]))
    for gs, ge in gaps:
        # walk the gap in pieces: each piece to the innermost (latest-starting) label covering it
        cuts = sorted({gs, ge, *[t for r in ranges for t in r[:2] if gs < t < ge]})
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            inner = [r for r in ranges if r[0] <= mid < r[1]]
            name = max(inner, key=lambda r: r[0])[2] if inner else "(outside any label)"
            out[name] += b - a
    return out, host, busy, hi - lo, len(steps), kernel_us, kernel_count


def graph_kernel_names(llm: LLM) -> set[str]:
    """Names of the kernels the captured target and drafter graphs run (each replayed once under
    the profiler, after the timed steps: their KV writes land in freed blocks)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    runners = [engine.runner] + ([engine.proposer.runner] if engine.proposer is not None else [])
    graphs = [c.graph for r in runners if r.graphs is not None for c in r.graphs.graphs.values()]
    if not graphs or not torch.cuda.is_available():
        return set()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@contextlib.contextmanager
def switched(texts: list[str]):
    """Set ``module:attr=value`` switches for the block, restore them after."""
    saved = []
    for text in texts:
        obj, name, value = parse_switch(text)
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def profile_steps(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[tuple, list[tuple[float, float, str]]]:
    """(:func:`idle_by_phase`'s tuple, the profile's GPU events ``(start us, end us, name)``)."""
    from torch.profiler import ProfilerActivity, profile

    step_time(llm, prompt, new_tokens, warm=False)
    sync(llm.config.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step_time(llm, prompt, new_tokens, warm=False)
        sync(llm.config.device)
    gpu = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("H ")]
    return idle_by_phase(prof), gpu


def between_replays(gpu: list[tuple[float, float, str]], in_graphs: set[str], min_replay: int = 20,
                    max_join_us: float = 1.0) -> list[tuple[list[tuple[str, float, float]], int, float, float]]:
    """What the GPU runs from the end of one graph replay to the start of the next, with the
    idle gap before each op, one entry per distinct op sequence, the most common first:
    ``([(name, gap before us, duration us), ...], segments, replay span us, replay start to next
    replay start us)``, medians over that sequence's segments. The last row is the next replay's
    start (its gap only).

    A replay is a run of at least ``min_replay`` kernels named as graph kernels (``in_graphs``),
    each starting at most ``max_join_us`` after the run's end so far (PDL kernels overlap: a
    negative gap). A shorter run keeps its kernels' names: an eager launch of a kernel that the
    graphs also run (the lm_head's GEMM) is listed, not merged into the replay."""
    runs: list[list] = []  # [start, end, name, kernels, is_graph]
    for s, e, name in sorted(gpu):
        is_graph = name in in_graphs
        last = runs[-1] if runs else None
        if is_graph and last is not None and last[4] and s - last[1] <= max_join_us:
            last[1], last[3] = max(last[1], e), last[3] + 1
        else:
            runs.append([s, e, name, 1, is_graph])
    ops = []  # (start, end, name); a replay is named None
    for s, e, name, count, is_graph in runs:
        if is_graph and count >= min_replay:
            ops.append((s, e, None))
        elif is_graph:  # too short for a replay: its kernels one by one (their own names kept)
            ops.extend(g for g in sorted(gpu) if s <= g[0] and g[1] <= e and g[2] in in_graphs)
        else:
            ops.append((s, e, name))
    replays = [i for i, op in enumerate(ops) if op[2] is None]
    groups: dict[tuple, list] = {}  # op names -> [(gaps, durations, replay span, period), ...]
    for a, b in zip(replays, replays[1:]):
        prev_end, gaps, durations = ops[a][1], [], []
        for s, e, _ in ops[a + 1 : b + 1]:
            gaps.append(s - prev_end)
            durations.append(e - s)
            prev_end = max(prev_end, e)
        names = tuple(op[2] for op in ops[a + 1 : b])
        groups.setdefault(names, []).append((gaps, durations, ops[a][1] - ops[a][0], ops[b][0] - ops[a][0]))

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    out = []
    for names, segs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        rows = [(name, median([g[0][i] for g in segs]), median([g[1][i] for g in segs]))
                for i, name in enumerate(names)]
        rows.append(("(next replay starts)", median([g[0][-1] for g in segs]), 0.0))
        out.append((rows, len(segs), median([g[2] for g in segs]), median([g[3] for g in segs])))
    return out


def print_between_replays(title: str, gpu: list[tuple[float, float, str]], in_graphs: set[str],
                          max_sequences: int = 2) -> None:
    """The tables of :func:`between_replays` (``--sequence``): its ``max_sequences`` most common
    op sequences (a DFlash step has two: after the verify, after the drafter block)."""
    groups = between_replays(gpu, in_graphs)
    if not groups:
        print(f"\n{title}: no two graph replays in the profile")
    for rows, segments, span, period in groups[:max_sequences]:
        print(f"\n{title}, from a replay's end to the next replay (median of {segments} alike; that "
              f"replay's span {span:.1f} us, replay start to next replay start {period:.1f} us, GPU idle "
              f"{sum(r[1] for r in rows if r[1] > 0):.1f} us)\n\n| GPU op | idle us before | us |\n|---|---:|---:|")
        for name, gap, us in rows:
            print(f"| `{name[:80]}` | {gap:.1f} | {us:.1f} |")


def print_profile(title: str, result: tuple, top: int, num_kernels: int = 0,
                  in_graphs: set[str] | None = None) -> None:
    idle, host, busy, window, steps, kernel_us, kernel_count = result
    if not steps:
        print(f"\n{title}: nothing recorded")
        return
    total_idle = sum(idle.values())
    print(f"\n{title} (profiled, {steps} steps): per step {window / steps:.0f} us, GPU busy "
          f"{busy / steps:.0f} us, GPU idle {total_idle / steps:.0f} us\n")
    print("| host phase | host us per step (inclusive) | GPU idle us per step in it | share of idle |\n"
          "|---|---:|---:|---:|")
    for name in sorted(set(host) | set(idle), key=lambda n: (-idle[n], -host[n]))[:top]:
        print(f"| {name[2:] if name.startswith('H ') else name} | {host[name] / steps:.1f} | "
              f"{idle[name] / steps:.1f} | {100 * idle[name] / max(total_idle, 1e-9):.0f}% |")
    if num_kernels:
        in_graphs = in_graphs or set()
        graph_us = sum(us for name, us in kernel_us.items() if name in in_graphs)
        eager_us = sum(kernel_us.values()) - graph_us
        print(f"\nGPU time per step: {graph_us / steps:.0f} us in graph kernels, {eager_us / steps:.0f} us "
              f"in {sum(c for n, c in kernel_count.items() if n not in in_graphs) / steps:.1f} eager "
              "kernels and copies\n\n| kernel | where | per step | us per step |\n|---|---|---:|---:|")
        for name, us in kernel_us.most_common(num_kernels):
            print(f"| `{name[:90]}` | {'graph' if name in in_graphs else 'eager'} | "
                  f"{kernel_count[name] / steps:.1f} | {us / steps:.1f} |")


def verify_gaps(llm: LLM, prompt: list[int], new_tokens: int,
                batch: int = 1) -> list[tuple[float, float, float, float, int, int]]:
    """Per DFlash step of ``batch`` requests with drafts queued ahead, without the profiler: (the
    host's time from the step's sync returning to the next verify's launch, the GPU's gap between
    the end of the drafter block queued ahead and the first work of that verify, the drafter
    block's GPU span, the host's time in the verify graph's replay call; us), then the KV blocks
    the host allocated and the full blocks it offered the prefix cache in that window
    (``register`` calls: a prefix already cached is a no-op) (block-boundary work, which a batch
    of equal prompts does in the same steps). The GPU columns come from CUDA events, one recorded after
    ``propose_ahead``'s last launch, one just before the verify graph's replay (it runs when the
    host reaches it, so a late host shows as a gap; the replay call's own latency is not in it,
    hence its own column: a wall time, an upper bound on what the GPU can wait for it), one
    before ``propose_ahead``'s first launch; on the CPU (graph runners attached: the same
    host path, the forwards inline) they are NaN. While the GPU runs the block queued ahead the
    host commits the step, schedules the next and prepares its verify: where that takes longer
    than the block, the GPU waits."""
    engine = llm.engine
    proposer, graphs = engine.proposer, engine.runner.graphs
    is_cuda = llm.config.device.startswith("cuda")
    pending: list = []
    rows: list[tuple] = []
    synced: list[float] = []  # when the last step's host sync returned (perf_counter)
    propose_ahead, forward = proposer.propose_ahead, graphs.forward
    replay, run_model, tolist = torch.cuda.CUDAGraph.replay, graphs._run_model, HostCopy.tolist
    allocator = engine.scheduler.allocator
    allocate, register = allocator.allocate, allocator.register
    blocks = [0, 0]  # allocated, registered since the last sync
    replay_us: dict[int, float] = {}  # row -> the host's time in its verify's replay call (CUDA)

    def counted_allocate(num_blocks: int) -> list[int]:
        blocks[0] += num_blocks
        return allocate(num_blocks)

    def counted_register(*args) -> None:
        blocks[1] += 1
        return register(*args)

    def event() -> torch.cuda.Event | None:
        if not is_cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed_tolist(copy):
        out = tolist(copy)
        synced[:] = [time.perf_counter()]
        blocks[:] = [0, 0]
        return out

    def timed_propose_ahead(*args, **kwargs):
        start = event()
        out = propose_ahead(*args, **kwargs)
        pending[:] = [start, event()] if out is not None else []
        return out

    is_verify = []

    def timed_forward(input_ids, items, *args, **kwargs):
        is_verify[:] = [bool(pending) and kwargs.get("tail_ids") is not None]
        try:
            return forward(input_ids, items, *args, **kwargs)
        finally:
            is_verify.clear()

    def launching() -> bool:  # the verify's launch: the host's time since the sync, an event
        if is_verify and is_verify[0] and synced:
            rows.append((1e6 * (time.perf_counter() - synced[0]), *pending, event(), *blocks))
            pending.clear()
            return True
        return False

    def timed_replay(graph):
        is_counted = launching()
        t0 = time.perf_counter()
        out = replay(graph)
        if is_counted:
            replay_us[len(rows) - 1] = 1e6 * (time.perf_counter() - t0)
        return out

    def timed_run_model(*args, **kwargs):  # the CPU's "replay": the padded forward, inline
        launching()
        return run_model(*args, **kwargs)

    # the batch's graphs captured first, untimed (and no state left from a run before: the timed
    # run's first step proposes, so its verify follows no block queued ahead and is not counted)
    step_time(llm, prompt, new_tokens, batch, warm=False)
    proposer.propose_ahead, graphs.forward, HostCopy.tolist = timed_propose_ahead, timed_forward, timed_tolist
    allocator.allocate, allocator.register = counted_allocate, counted_register
    torch.cuda.CUDAGraph.replay = timed_replay
    if not is_cuda:
        graphs._run_model = timed_run_model
    try:
        step_time(llm, prompt, new_tokens, batch, warm=False)
        sync(llm.config.device)
    finally:
        proposer.propose_ahead, graphs.forward, HostCopy.tolist = propose_ahead, forward, tolist
        del allocator.allocate, allocator.register  # the class's methods again
        torch.cuda.CUDAGraph.replay = replay
        if not is_cuda:
            del graphs._run_model
    if not is_cuda:  # the CPU's "replay" is the forward itself: no launch to time
        return [(host, math.nan, math.nan, math.nan, allocated, registered)
                for host, _, _, _, allocated, registered in rows]
    return [(host, 1e3 * done.elapsed_time(verify), 1e3 * start.elapsed_time(done), replay_us[i], allocated,
             registered)
            for i, (host, start, done, verify, allocated, registered) in enumerate(rows)]


@contextlib.contextmanager
def gc_pauses():
    """Yields ``{generation: [pause us, ...]}``, filled by ``gc.callbacks`` with every garbage
    collection that runs inside the block (the host time each took, in us)."""
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses[info["generation"]].append(1e6 * (time.perf_counter() - started.pop()))

    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)


def full_collection_ms(repeats: int = 3) -> float:
    """Median host time of ``gc.collect()`` (all generations), ms."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def print_gc(batch: int, pauses: dict[int, list[float]]) -> None:
    """One line: the collections of each generation during a batch size's steps, and the
    longest pause."""
    parts = [f"gen {g}: {len(p)}" + (f" (longest {max(p):.0f} us)" if p else "") for g, p in pauses.items()]
    print(f"gc during batch {batch}: " + ", ".join(parts))


def print_gaps(k: int, batch: int, rows: list[tuple[float, float, float, float, int, int]]) -> None:
    """One row of the gaps table: medians (min-max) over the steps of one batch size."""
    def spread(values: list[float]) -> str:
        values = sorted(values)
        return "n/a" if math.isnan(values[0]) else f"{values[len(values) // 2]:.1f} ({values[0]:.1f}-{values[-1]:.1f})"
    if rows:
        host, gap, span, replay_call = list(zip(*rows))[:4]
        print(f"| {batch} | {len(rows)} | {spread(list(host))} | {spread(list(gap))} | {spread(list(span))} | "
              f"{spread(list(replay_call))} |")
    else:
        print(f"| {batch} | 0 (no drafts ahead at DFlash K={k}) | | | | |")


def print_gap_steps(batch: int, rows: list[tuple[float, float, float, float, int, int]]) -> None:
    """The steps of one batch size in order: host window, GPU gap, and the block work in the
    window (where a slow window meets an allocation or prefix-cache registration)."""
    print(f"\nbatch {batch}, step by step\n\n| step | host us | GPU gap us | KV blocks allocated | "
          "full blocks offered to the prefix cache |\n|---:|---:|---:|---:|---:|")
    for i, (host, gap, _, _, allocated, registered) in enumerate(rows):
        print(f"| {i} | {host:.1f} | {'n/a' if math.isnan(gap) else f'{gap:.1f}'} | {allocated} | {registered} |")


def lm_head_table(device: str, n: int = 100352, k: int = 2048, copies: int = 3) -> list[tuple]:
    from laguna_dflash.kernels import skinny_gemm

    rows = []
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    for m in (1, 3, 4):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        cfg = skinny_gemm.default_config(m, n, k)
        for name, fn in (("F.linear", lambda w, x=x: torch.nn.functional.linear(x, w)),
                         ("skinny", lambda w, x=x, cfg=cfg: skinny_gemm.skinny_gemm(x, w, cfg))):
            for w in ws:
                fn(w)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(4):
                    for w in ws:
                        fn(w)
            g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            us = 1e3 * start.elapsed_time(end) / (10 * 4 * copies)
            rows.append((m, name, us, n * k * 2 / (us * 1e-6) / 1e12))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default=None,
                    help="the drafter's streamed weights (LLM(draft_quantization=...); fp8: models/fp8.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--kernels", type=int, default=0,
                    help="also list the N kernels with the most GPU time per profiled step")
    ap.add_argument("--sequence", action="store_true",
                    help="also list, per profiled mode, the GPU ops between two graph replays in order "
                         "with the idle time before each (the eager lm_head, copies, uploads)")
    ap.add_argument("--device", default="cuda", help="cpu: a wiring check at small widths")
    ap.add_argument("--gaps", action="store_true",
                    help="also time, without the profiler, the host's path from a DFlash step's sync "
                         "to the next verify's launch and the GPU's wait for that launch after the "
                         "drafter block queued ahead (CUDA events; on the CPU the host's time only)")
    ap.add_argument("--gap-batches", default="1",
                    help="batch sizes of the --gaps table (default 1), e.g. 1,16,64")
    ap.add_argument("--gap-steps", action="store_true",
                    help="with --gaps: also list every step of each batch size (host window, GPU gap, "
                         "the KV blocks allocated and offered to the prefix cache in the window)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the profiled steps (the step times and --gaps only)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.collect(); gc.freeze() once the engine is built (what `serve` does at "
                         "start-up)")
    ap.add_argument("--switch", action="append", default=[],
                    help="module:attr=value[;module:attr=value]: a row against the defaults "
                         "(repeatable; the first also gets the profile tables)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    gap_batches = [int(b) for b in args.gap_batches.split(",")] if args.gaps else []
    if any(b < 1 for b in gap_batches):
        ap.error(f"--gap-batches takes batch sizes >= 1, got {args.gap_batches!r}")
    if args.gap_steps and not args.gaps:
        ap.error("--gap-steps lists the steps of --gaps: add --gaps")
    max_batch = max(gap_batches, default=1)
    if not cpu:  # before the engine takes the memory
        print("| lm_head M | kernel | us | TB/s |\n|---:|---|---:|---:|")
        for m, name, us, tbs in lm_head_table("cuda"):
            print(f"| {m} | {name} | {us:.1f} | {tbs:.2f} |")
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = Path(tmp) / "target", Path(tmp) / "draft"
        tdir.mkdir()
        ddir.mkdir()
        tcfg, dcfg = xs_target_config(args.layers), xs_draft_config(args.layers)
        if cpu:  # shrink every width, keep the structure
            for c in (tcfg, dcfg):
                c.update(hidden_size=128, intermediate_size=256, vocab_size=512, head_dim=32)
            dcfg["draft_vocab_size"] = 512
            tcfg.update(num_experts=16, moe_intermediate_size=64, shared_expert_intermediate_size=64)
        (tdir / "config.json").write_text(json.dumps(tcfg))
        (ddir / "config.json").write_text(json.dumps(dcfg))
        llm = LLM(str(tdir), draft=str(ddir), draft_quantization=args.draft_quantization,
                  dtype="float32" if cpu else "bfloat16",
                  device=args.device, load_format="dummy", enforce_eager=cpu,
                  max_model_len=args.context + 256, max_num_seqs=max_batch,
                  # room for the hybrid layout at any --layers: its sliding groups each hold the
                  # whole 1k context (window >= context), so a few layers' groups need more
                  # blocks than the unified layout (8 layers: 327 where x 2 gave 312)
                  num_kv_blocks=(args.context + 320) // 16 * max(4, max_batch + 1))
        engine = llm.engine
        if args.gc_freeze:
            before = full_collection_ms()
            gc.freeze()
            print(f"gc.freeze(): {gc.get_freeze_count()} objects of the start-up heap frozen; a full "
                  f"collection took {before:.2f} ms before, {full_collection_ms():.2f} ms after (median of 3)")
        prompt = torch.randint(100, tcfg["vocab_size"] - 1, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        proposer, taps = engine.proposer, engine.tap_layer_ids
        engine.simulated_acceptance, engine._sim_carry = 1.0, 0.0
        engine.num_speculative_tokens = args.k

        @contextlib.contextmanager
        def target_only():
            engine.proposer, engine.tap_layer_ids = None, ()
            try:
                yield
            finally:
                engine.proposer, engine.tap_layer_ids = proposer, taps

        def reset_graphs():
            for g in (engine.runner.graphs, proposer.runner.graphs):
                if g is not None:
                    g.reset()
            if proposer.context_graphs is not None:
                proposer.context_graphs.graphs.clear()
                proposer.context_graphs.pool = None

        print(f"\n{torch.cuda.get_device_name() if not cpu else 'cpu'}, torch {torch.__version__}, "
              f"layers {args.layers}, context {args.context}, K = {args.k} (acceptance forced to 1)")
        # rows: the defaults, then each --switch, interleaved over rounds (min kept), every row
        # on graphs captured after a reset
        variants = [("defaults", [])] + [(text, text.split(";")) for text in args.switch]
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds):
            for name, texts in variants:
                with switched(texts):
                    reset_graphs()
                    for mode in ("target-only", f"DFlash K={args.k}"):
                        with target_only() if mode == "target-only" else contextlib.nullcontext():
                            step_time(llm, prompt, args.new_tokens)  # captures
                            t = 1e3 * step_time(llm, prompt, args.new_tokens, warm=False)
                        best[name, mode] = min(t, best.get((name, mode), t))
                reset_graphs()
        print(f"\n| variant | target-only ms | DFlash K={args.k} ms | {args.k + 1} tokens per step: "
              "x target-only |\n|---|---:|---:|---:|")
        for name, _ in variants:
            base, spec = best[name, "target-only"], best[name, f"DFlash K={args.k}"]
            print(f"| {name} | {base:.2f} | {spec:.2f} | {(args.k + 1) * base / spec:.2f} |")
        if gap_batches:
            if cpu:  # the graph runners' host path (on the CPU they run the padded forwards inline)
                engine.attach_graph_runners()
            print(f"\nDFlash K={args.k}, steps with drafts ahead (no profiler), us: median (min-max)\n\n"
                  "| batch | steps | host: sync -> next verify launch | GPU gap: drafter block queued "
                  "ahead -> verify | drafter block span | host: the verify's replay call |\n"
                  "|---:|---:|---|---|---|---|")
            collections, steps = {}, {}
            for batch in gap_batches:
                with gc_pauses() as collections[batch]:
                    steps[batch] = verify_gaps(llm, prompt, args.new_tokens, batch)
                print_gaps(args.k, batch, steps[batch])
            print()
            for batch, pauses in collections.items():
                print_gc(batch, pauses)
            if args.gap_steps:
                for batch, rows in steps.items():
                    print_gap_steps(batch, rows)
            if cpu:
                engine.runner.graphs = proposer.runner.graphs = None
        if args.no_profile:
            return
        install_labels(llm)
        for name, texts in variants[:2]:
            with switched(texts):
                reset_graphs()
                for mode in ("target-only decode", f"DFlash K={args.k}"):
                    with target_only() if mode == "target-only decode" else contextlib.nullcontext():
                        result, gpu = profile_steps(llm, prompt, args.new_tokens)
                        in_graphs = graph_kernel_names(llm) if args.kernels or args.sequence else None
                    print_profile(f"{name}: {mode}", result, args.top, args.kernels, in_graphs)
                    if args.sequence:
                        print_between_replays(f"{name}: {mode}", gpu, in_graphs)
            reset_graphs()

if __name__ == "__main__":
    main()
