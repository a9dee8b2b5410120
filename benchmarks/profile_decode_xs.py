"""Where a batch-1 Laguna-XS-2.1-size decode step spends its time, on one GPU.

Target only (dummy bf16 weights at the real shapes, a 1k-token context, engine defaults). Prints:

* the engine's decode step (``decode_s / num_decode_steps``), the replay of the step's CUDA graph
  alone (CUDA events, back to back), and so the host's share of the step;
* the graph's kernels, from a profile of replays: count and summed time per replay, the gap
  (replay time minus kernel time), the kernels by name, and the kernel sequence of the first
  layers in launch order (``--sequence N``);
* batch-1 GEMV time against the weight bytes for the step's projection shapes (``torch.nn.functional
  .linear`` at M = 1, weights rotated over copies so they come from HBM, in a CUDA graph);
* with ``--switch module:attr=value`` (repeatable): the same numbers with the switch set, for A/B
  comparisons of fast-path options in one run;
* with ``--ablate NAME[+NAME]`` (repeatable; benchmarks/ablations.py): the same numbers with
  those latency-bound steps removed from the chain (timing only, the output is wrong): an upper
  bound on what fusing them away could save.

    python benchmarks/profile_decode_xs.py --sequence 70
    python benchmarks/profile_decode_xs.py --switch laguna_dflash.models.fusion:enabled=False
    python benchmarks/profile_decode_xs.py --ablate routing --ablate routing+merge
    python benchmarks/profile_decode_xs.py --drafter --k 3   # the drafter block's graph instead

With ``--drafter`` the engine carries the XS-2.1-size drafter (5 dense layers, 64 heads, random
weights; every draft rejected, so every step has the same shapes) and the graph profiled is the
drafter block of ``K + 1`` tokens; the engine step is then the DFlash step, and the floor is the
drafter layers' weight bytes (the shared lm_head and the argmax run after the graph).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import ablations
import torch
from bench_gpu_xs import (
    active_bytes,
    copy_bandwidth,
    parse_switch,
    xs_draft_config,
    xs_target_config,
)

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import DRAFT_QUANTIZATIONS
from laguna_dflash.engine.cuda_graph import CUDAGraphRunner
from laguna_dflash.engine.runner import ForwardItem


def engine_step_ms(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """(mean ms per decode step, the greedy tokens of the timed run)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    before = llm.get_metrics()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    torch.cuda.synchronize()
    after = llm.get_metrics()
    steps = after["num_decode_steps"] - before["num_decode_steps"]
    return 1e3 * (after["decode_s"] - before["decode_s"]) / steps, list(out[0].token_ids)


def verify_tables(llm: LLM, q: int, context: int) -> list[list[int]]:
    """K/V blocks for a verify-shaped forward of ``q`` tokens after ``context``: one table per KV
    group of the layout (the hybrid layout's sliding groups take blocks of the same pool:
    scheduler.Scheduler), each covering the whole sequence; where they lie is printed."""
    allocator = llm.engine.allocator
    tables = [allocator.allocate(allocator.blocks_needed(context + q, 0))
              for _ in range(1 + llm.engine.scheduler.num_swa_groups)]
    for i, ids in enumerate(tables):
        jumps = sum(b != a + 1 for a, b in zip(ids, ids[1:]))
        print(f"verify graph's table {i}: {len(ids)} blocks {ids[0]}..{ids[-1]}, {jumps} jumps")
    return tables


def placement_tables(llm: LLM, spec: str, q: int, context: int) -> list[list[int]]:
    """Explicit K/V blocks for a verify-shaped forward (one table per KV group, each covering
    the sequence), taken out of the free pool (:meth:`BlockAllocator.share`; free them after).
    ``spec``: ``contig@B`` (group g's table the run ``B + g n ..``), ``reverse@B`` (the same
    runs descending), ``interleave@B`` (group g's block i is ``B + G i + g``), ``stride@S@B``
    (each group a run with stride S, groups after one another), ``mix@F@S`` (the full group's
    run at F, the sliding groups' runs from S); a ``+fill`` suffix first writes the same K/V
    into every block (:func:`fill_kv_blocks`)."""
    allocator = llm.engine.allocator
    num_groups = 1 + llm.engine.scheduler.num_swa_groups
    n = allocator.blocks_needed(context + q, 0)
    spec, fill = spec.removesuffix("+fill"), spec.endswith("+fill")
    kind, *nums = spec.split("@")
    base = int(nums[-1]) if nums else 0
    if kind == "contig":
        tables = [[base + g * n + i for i in range(n)] for g in range(num_groups)]
    elif kind == "reverse":
        tables = [[base + g * n + n - 1 - i for i in range(n)] for g in range(num_groups)]
    elif kind == "interleave":
        tables = [[base + num_groups * i + g for i in range(n)] for g in range(num_groups)]
    elif kind == "mix" and len(nums) == 2:
        full, swa = int(nums[0]), int(nums[1])
        tables = [[(full if g == 0 else swa + (g - 1) * n) + i for i in range(n)] for g in range(num_groups)]
    elif kind == "stride" and len(nums) == 2:
        s = int(nums[0])
        tables = [[base + g * n * s + s * i for i in range(n)] for g in range(num_groups)]
    else:
        raise SystemExit(f"--placement {spec}: expected contig@B, reverse@B, interleave@B, "
                         "stride@S@B or mix@F@S")
    ids = [b for t in tables for b in t]
    if (max(ids) >= allocator.num_blocks or len(set(ids)) != len(ids)
            or allocator.num_unreferenced(ids) != len(ids)):
        raise SystemExit(f"--placement {spec}: blocks {min(ids)}..{max(ids)} are not all free in a "
                         f"pool of {allocator.num_blocks}; pick a smaller base")
    allocator.reset_prefix_cache()  # their K/V get overwritten
    allocator.share(ids)
    if fill:  # every block of the pool the same K/V: the graph's output no longer depends on where
        fill_kv_blocks(llm)
    return tables


def fill_kv_blocks(llm: LLM, seed: int = 0) -> None:
    """Write one seeded random block of K/V (per pool tensor) into every block of the target's
    pool: a forward then attends to the same keys and values wherever its tables point, so its
    routing, and what its MoE kernels read, are the same too."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = llm.engine.runner.kv_cache
    for k, v in cache.pool:
        for t in (k, v):
            blocks = t.view(-1, cache.block_size, *t.shape[1:])
            pattern = torch.randn(blocks.shape[1:], generator=g, device=t.device, dtype=torch.float32)
            blocks.copy_(pattern.to(t.dtype).expand_as(blocks))
    llm.engine.allocator.reset_prefix_cache()


def attention_by_group(llm: LLM, graph, by_name: Counter | None = None) -> str:
    """One profiled replay's attention kernel time per KV group, the merges', the rest's (us),
    as table cells: the i-th attention launch is layer i's. ``by_name``: also summed per kernel
    name into it."""
    one = graph_kernels(graph)[-1]
    for name, _, d in one if by_name is not None else ():
        by_name[name[:70]] += d
    groups = llm.engine.runner.kv_cache.group_of_layer
    per_group, merge, rest, layer = Counter(), 0.0, 0.0, 0
    for name, _, d in one:
        if "_paged_attention_kernel" in name:
            per_group[groups[layer] if layer < len(groups) else 0] += d
            layer += 1
        elif "_merge_splits_kernel" in name:
            merge += d
        else:
            rest += d
    return " | ".join([*(f"{per_group[g]:.0f}" for g in sorted(per_group)), f"{merge:.0f}", f"{rest:.0f}"])


def decode_graph(llm: LLM, q: int = 1, context: int = 1024, tables: list[list[int]] | None = None,
                 fill_kv: bool = True):
    """The batch-1 graph of ``q`` tokens per request (1: the decode step; > 1: a verify-shaped
    target forward at the end of a ``context``-token sequence, captured here if needed, on
    ``tables`` (:func:`verify_tables`; None: new ones, freed after the capture, and with
    ``fill_kv`` every block's K/V made the same first).

    The replay attends to whatever K/V its blocks hold, and those steer the MoE routing: on the
    stale K/V of earlier runs the same graph replayed 3.67-3.84 ms depending on which blocks it
    got, on filled blocks 3.83 ms wherever they lay (docs/PERFORMANCE.md, fifty-third pass). So
    rows compare on filled blocks unless ``--stale-kv``."""
    engine = llm.engine
    runner = engine.runner
    if q > runner.graphs.max_tokens_per_request:  # a target-only engine captures q = 1 only
        # keep the prefill graphs: the defaults' row prefilled through them, and an eager
        # prefill sums differently in bf16, so later rows' tokens would not compare with its
        runner.graphs = CUDAGraphRunner(runner.model, runner.kv_cache, runner.backend, runner.device,
                                        1, engine.max_model_len, q, runner.graphs.max_prefill_tokens)
    if q > 1 and not any(k[0] == 1 and k[1] == q for k in runner.graphs.graphs):
        own = tables is None
        tables = verify_tables(llm, q, context) if own else tables
        if own and fill_kv:
            fill_kv_blocks(llm)
        try:
            item = ForwardItem(q, context, context + q, tables[0], tuple(tables[1:]))
            runner.forward(list(range(100, 100 + q)), [item])
            torch.cuda.synchronize()
        finally:
            # the graph keeps only shapes; its slots are rewritten per replay
            for blocks in tables if own else ():
                engine.allocator.free(blocks)
    graphs = runner.graphs.graphs
    key = max((k for k in graphs if k[0] == 1 and k[1] == q), key=lambda k: k[2])
    return graphs[key].graph


def reset_graphs(llm: LLM) -> None:
    """Drop the captured graphs of the target and of the drafter (if any): the next forwards
    recapture them with the module switches of the moment."""
    engine = llm.engine
    for runner in (engine.runner, getattr(engine.proposer, "runner", None)):
        if runner is not None and runner.graphs is not None:
            runner.graphs.reset()


def drafter_graph(llm: LLM, k: int):
    """The batch-1 drafter block graph of ``k + 1`` tokens (captured by the engine's steps)."""
    graphs = llm.engine.proposer.runner.graphs.graphs
    keys = [key for key in graphs if key[0] == 1 and key[1] == k + 1]
    if not keys:
        raise RuntimeError(f"no batch-1 drafter graph of {k + 1} tokens was captured: {sorted(graphs)}")
    return graphs[max(keys, key=lambda key: key[2])].graph


def drafter_layer_bytes(llm: LLM) -> int:
    """Weight bytes the drafter block's graph reads: the drafter's layers (its fc and context
    projection run in the context store, the lm_head after the graph)."""
    layers = llm.engine.drafter.layers
    fp8 = [b for name, b in layers.named_buffers() if name.endswith(("weight", "weight_scale"))]  # models/fp8.py
    return sum(t.numel() * t.element_size() for t in [*layers.parameters(), *fp8])


def replay_ms(graph, n: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def graph_kernels(graph, n: int = 3) -> list[list[tuple[str, float, float]]]:
    """Kernels of ``n`` replays: per replay a list of (name, start us, duration us) in order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
            torch.cuda.synchronize()
    events = sorted(
        ((e.name, e.time_range.start, e.time_range.end - e.time_range.start)
         for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda x: x[1],
    )
    if not events:
        return []
    # replays are separated by a host sync: split at the largest gaps
    gaps = sorted(range(1, len(events)), key=lambda i: events[i][1] - events[i - 1][1])[-(n - 1):]
    bounds = [0, *sorted(gaps), len(events)]
    return [events[a:b] for a, b in zip(bounds, bounds[1:])]


def gemv_table(device: str, shapes: dict[str, tuple[int, int]], copies: int = 8) -> list[tuple]:
    rows = []
    x = torch.randn(1, 1, device=device, dtype=torch.bfloat16)
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        for w in ws:
            torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(4):
                for w in ws:
                    torch.nn.functional.linear(x, w)
        ms = replay_ms(g, 20) / (4 * copies)
        rows.append((name, n, k, ms * 1e3, n * k * 2 / (ms * 1e-3) / 1e12))
        del ws, g
    return rows


def report(label: str, llm: LLM, prompt: list[int], args, floor_ms: float,
           reference: list[int] | None = None) -> list[int]:
    """Print one variant's numbers; returns its greedy tokens. ``reference``: the defaults'
    tokens, to say whether the switch changed the output (a switch that only changes launch
    timing, like PDL, must not; one that changes the summation order may, in bf16)."""
    step, tokens = engine_step_ms(llm, prompt, args.new_tokens)
    graph = (drafter_graph(llm, args.k) if args.drafter
             else decode_graph(llm, args.q, args.context, fill_kv=not args.stale_kv))
    replay = replay_ms(graph)
    replays = graph_kernels(graph)
    print(f"\n## {label}\n")
    if reference is not None:
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"greedy tokens equal to the defaults': {same} of {len(reference)}\n")
    if args.drafter:
        print(f"(the engine step is the DFlash K = {args.k} step; the replay is the drafter block's "
              f"graph of {args.k + 1} tokens, its floor the drafter layers' weight bytes)\n")
    elif args.q > 1:  # the step is still the decode step: no host share to derive
        print(f"(the engine step is the 1-token decode step; the replay is the {args.q}-token graph, "
              "its x floor against the decode floor)\n")
    host = f"{step - replay:.2f}" if args.q == 1 and not args.drafter else "-"
    print("| engine step ms | graph replay ms | host share ms | floor ms | step x floor | replay x floor |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {step:.2f} | {replay:.2f} | {host} | {floor_ms:.2f} | "
          f"{step / floor_ms:.2f} | {replay / floor_ms:.2f} |")
    if not replays:
        print("\n(no kernels recorded inside the graph replay)")
        return tokens
    one = replays[-1]
    kernel_ms = sum(d for _, _, d in one) / 1e3
    span_ms = (one[-1][1] + one[-1][2] - one[0][1]) / 1e3
    print(f"\nkernels per replay {len(one)}, summed kernel time {kernel_ms:.2f} ms, first-to-last span "
          f"{span_ms:.2f} ms, so {1e3 * (span_ms - kernel_ms) / max(len(one) - 1, 1):.2f} us between kernels")
    by_name, count = Counter(), Counter()
    for name, _, d in one:
        by_name[name[:80]] += d
        count[name[:80]] += 1
    print("\n| kernel | per replay | us per replay | share |\n|---|---:|---:|---:|")
    for name, us in by_name.most_common(args.top):
        print(f"| `{name}` | {count[name]} | {us:.0f} | {us / 10 / kernel_ms:.1f}% |")
    added = span_added(one)
    span_by_name = Counter()
    for (name, _, _), a in zip(one, added):
        span_by_name[name[:80]] += a
    print("\n| kernel | span added us per replay | share of the span |\n|---|---:|---:|")
    for name, us in span_by_name.most_common(args.top):
        print(f"| `{name}` | {us:.0f} | {us / 10 / span_ms:.1f}% |")
    recaptures = args.recapture if args.q > 1 and not args.drafter else 0
    # the same graph captured again: new graph-pool buffers each time, and new K/V blocks (the
    # allocator's free list is FIFO) unless --fixed-blocks holds one set for every recapture
    fixed = verify_tables(llm, args.q, args.context) if recaptures and args.fixed_blocks else None
    if fixed and not args.stale_kv:
        fill_kv_blocks(llm)
    for i in range(recaptures):
        llm.engine.runner.graphs.reset()
        graph = decode_graph(llm, args.q, args.context, fixed, fill_kv=not args.stale_kv)
        print(f"recapture {i + 1}: replay {replay_ms(graph):.3f} ms; attention us per KV group, "
              f"merges, rest: {attention_by_group(llm, graph)}")
    for blocks in fixed or ():
        llm.engine.allocator.free(blocks)
    if args.placement and args.q > 1 and not args.drafter:
        print("\n| placement | replay ms | attention us per KV group (0: full) | merges us | rest us |")
        sums = []
        for spec in args.placement:
            tables = placement_tables(llm, spec, args.q, args.context)
            try:
                llm.engine.runner.graphs.reset()
                graph = decode_graph(llm, args.q, args.context, tables)
                sums.append(Counter())
                print(f"| {spec} | {replay_ms(graph):.3f} | {attention_by_group(llm, graph, sums[-1])} |")
            finally:
                for blocks in tables:
                    llm.engine.allocator.free(blocks)
        # the kernels whose summed time moves most across the placements (PDL: a kernel's time
        # includes its wait for the one before)
        spread = {k: max(c[k] for c in sums) - min(c[k] for c in sums) for k in sums[0]}
        print("\n| kernel (us per replay, one column per placement) | " + " | ".join(args.placement) + " |")
        for name in sorted(spread, key=spread.get, reverse=True)[: args.top]:
            print(f"| `{name}` | " + " | ".join(f"{c[name]:.0f}" for c in sums) + " |")
    if args.sequence:
        print("\n| # | kernel (launch order) | us | gap before us | span added us |\n|---:|---|---:|---:|---:|")
        for i, (name, start, d) in enumerate(one[: args.sequence]):
            gap = start - (one[i - 1][1] + one[i - 1][2]) if i else 0.0
            print(f"| {i} | `{name[:90]}` | {d:.1f} | {gap:.1f} | {added[i]:.1f} |")
    return tokens


def ncu_replay(llm: LLM, prompt: list[int], args) -> None:
    """Capture the profiled graph (an engine run), replay it twice to warm up, then once inside
    the NVTX range ``measure``: ncu --nvtx-include 'measure/' profiles that replay's kernels, each
    graph node on its own (serialized: PDL overlap and launch gaps are not in these durations)."""
    engine_step_ms(llm, prompt, args.new_tokens)
    graph = drafter_graph(llm, args.k) if args.drafter else decode_graph(llm, args.q, args.context)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    graph.replay()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def span_added(kernels: list[tuple[str, float, float]]) -> list[float]:
    """Per kernel ``(name, start, duration)`` in launch order: how far its end passes the latest
    end before it (the first: its duration). They sum to the first-to-last span when the kernels
    start in order; with PDL a kernel's own duration includes the wait it was launched early for,
    and this does not count that twice."""
    added, latest = [], None
    for _, start, duration in kernels:
        end = start + duration
        added.append(duration if latest is None else max(0.0, end - latest))
        latest = end if latest is None else max(latest, end)
    return added


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--also-context", type=int, action="append", default=[],
                    help="after the --context rows, the same rows (defaults and switches) at this "
                         "context, on the same engine (repeatable)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--sequence", type=int, default=0, help="print the first N kernels in order")
    ap.add_argument("--recapture", type=int, default=0,
                    help="with --q > 1: capture the graph N more times per row (new K/V blocks and "
                         "graph-pool buffers each time) and print each capture's replay time")
    ap.add_argument("--fixed-blocks", action="store_true",
                    help="with --recapture: every recapture on the same K/V blocks (only the "
                         "graph pool's buffers move)")
    ap.add_argument("--placement", action="append", default=[],
                    help="with --q > 1: capture the graph again on these K/V blocks and print its "
                         "replay and attention per KV group (placement_tables: contig@B, "
                         "reverse@B, interleave@B, stride@S@B, mix@F@S; +fill: the same K/V in every "
                         "block first; repeatable)")
    ap.add_argument("--stale-kv", action="store_true",
                    help="with --q > 1: capture the verify graph on its blocks' K/V as earlier runs "
                         "left them, not on filled blocks (decode_graph)")
    ap.add_argument("--pool-factor", type=int, default=2,
                    help="KV pool: this many sequences' blocks (falls back to 4 where it cannot "
                         "hold one)")
    ap.add_argument("--switch", action="append", default=[],
                    help="module:attr=value[;module:attr=value] to compare against the defaults "
                         "(repeatable)")
    ap.add_argument("--set", action="append", default=[], dest="settings",
                    help="module:attr=value set before the engine is built, for every row (e.g. "
                         "laguna_dflash.engine.kv_cache:MAX_KV_GROUPS=0, the unified KV layout; "
                         "repeatable)")
    ap.add_argument("--ablate", action="append", default=[],
                    help="NAME[+NAME] of benchmarks/ablations.py: time the step without those "
                         "kernels (wrong output; an upper bound on fusing them away; repeatable)")
    ap.add_argument("--carveout", type=int, default=None,
                    help="every Triton kernel's preferred shared-memory carveout, percent "
                         "(benchmarks/carveout.py; every row of this process)")
    ap.add_argument("--gemv", action="store_true", help="also time M=1 GEMVs of the step's shapes")
    ap.add_argument("--q", type=int, default=1,
                    help="profile the batch-1 graph of this many tokens (4: a K = 3 verify's target "
                         "forward; its replay against the decode floor is then only a reference)")
    ap.add_argument("--drafter", action="store_true",
                    help="profile the drafter block's graph of a DFlash K step instead (module docstring)")
    ap.add_argument("--k", type=int, default=3, help="with --drafter: draft tokens per step")
    ap.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default=None,
                    help="with --drafter: its o_proj and MLP (and lm_head copy) in fp8 (models/fp8.py)")
    ap.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                    help="the engine option (0: prefills eager; a narrower request-state row "
                         "for the decode graphs), for a decode A/B in two processes")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine with EngineConfig.batch_invariant (kernels/batch_invariant.py)")
    ap.add_argument("--moe-only", action="store_true",
                    help="after the rows, the expert GEMVs alone on the engine's own expert tensors: "
                         "the router's ids against fixed ones (moe_only)")
    ap.add_argument("--ncu", action="store_true",
                    help="only replay the graph once inside the NVTX range 'measure', for Nsight "
                         "Compute (bash benchmarks/gpu_check.sh ncu-decode); prints no table; with "
                         "--ablate, the first ablation's graph")
    args = ap.parse_args()
    if args.drafter and not 1 <= args.k <= 15:
        raise SystemExit(f"--k {args.k}: the XS drafter drafts 1..15 tokens a step (block size 16)")
    if args.carveout is not None:
        import carveout

        carveout.install(args.carveout)
        print(f"every Triton kernel's preferred shared-memory carveout: {args.carveout}%")
    for text in args.settings:  # before the engine: a layout is chosen when it is built
        obj, name, value = parse_switch(text)
        setattr(obj, name, value)
        print(f"set {text}")
    bw = copy_bandwidth("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(xs_target_config(args.layers)))
        draft = {}
        if args.drafter:
            (Path(tmp) / "draft").mkdir()
            (Path(tmp) / "draft" / "config.json").write_text(json.dumps(xs_draft_config(args.layers)))
            draft = {"draft": str(Path(tmp) / "draft"), "draft_quantization": args.draft_quantization}
        t0 = time.perf_counter()
        longest = max([args.context, *args.also_context])

        def build(num_kv_blocks: int) -> LLM:
            return LLM(tmp, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=1,
                       max_model_len=longest + 256, num_kv_blocks=num_kv_blocks,
                       batch_invariant=args.batch_invariant, **draft,
                       **({} if args.max_prefill_graph_tokens is None
                          else {"max_prefill_graph_tokens": args.max_prefill_graph_tokens}))

        # the pool of every earlier pass: where the verify graph's K/V land in it moved its
        # replay by 4% (fifty-second pass), so keep it; a few layers with a drafter need more
        # (a hybrid block then holds a larger share of the drafter's layers)
        try:
            llm = build((longest + 320) // 16 * args.pool_factor)
        except ValueError as e:
            if "cannot hold" not in str(e):
                raise
            gc.collect()
            torch.cuda.empty_cache()
            llm = build((longest + 320) // 16 * 4)
        load_s = time.perf_counter() - t0
        prompt = torch.randint(100, 100000, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        if args.drafter:  # every draft rejected: every step drafts K and verifies K + 1
            engine = llm.engine
            engine.num_speculative_tokens = min(args.k, engine.num_speculative_tokens)
            engine.simulated_acceptance, engine._sim_carry = 1.0, 0.0
            floor_ms = 1e3 * drafter_layer_bytes(llm) / bw
        else:
            floor_ms = 1e3 * active_bytes(llm.engine.target, args.context) / bw
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, layers {args.layers}, "
              f"context {args.context}, load + warm-up {load_s:.0f}s, copy bandwidth {bw / 1e12:.2f} TB/s")
        # Every row, the defaults' too, runs on graphs captured after a reset: in the fifth pass
        # the host share was 0.3-0.4 ms in a row on the engine's warm-up graphs and 0.6-0.8 ms
        # in every row after a reset, whatever the switch (docs/PERFORMANCE.md)
        reset_graphs(llm)
        if args.ncu:  # one graph: the defaults', or the first --ablate's
            if args.ablate:
                ablations.apply(args.ablate[0])
                reset_graphs(llm)
            ncu_replay(llm, prompt, args)
            return
        rows(llm, prompt, args, floor_ms)
        if args.moe_only:
            moe_only(llm)
        for context in args.also_context:
            args.context = context
            prompt = torch.randint(100, 100000, (context,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            if not args.drafter:
                floor_ms = 1e3 * active_bytes(llm.engine.target, context) / bw
            print(f"\n# context {context}")
            reset_graphs(llm)
            rows(llm, prompt, args, floor_ms)
    if args.gemv:
        h = 2048
        shapes = {"qkv (64 heads)": (8192 + 2048, h), "qkv+gate (64 heads)": (8192 + 2048 + 64, h),
                  "o (64 heads)": (h, 8192), "router": (256, h), "shared gate_up": (1024, h),
                  "shared down": (h, 512), "dense gate_up": (16384, h), "lm_head": (100352, h)}
        print("\n| GEMV M=1 | N | K | us | TB/s of weights |\n|---|---:|---:|---:|---:|")
        for name, n, k, us, tbs in gemv_table("cuda", shapes):
            print(f"| {name} | {n} | {k} | {us:.1f} | {tbs:.2f} |")


def moe_layers(model: torch.nn.Module) -> list:
    """The model's MoE blocks whose shared expert is folded in (the decode graph's expert GEMVs
    run on their ``fused_experts()``), in layer order."""
    from laguna_dflash.models.layers import MoE

    return [m for m in model.modules() if isinstance(m, MoE) and m.gate_up_with_shared is not None]


def moe_only(llm: LLM, reps: int = 20) -> None:
    """The decode graph's expert GEMVs alone on the engine's own expert tensors (the loaded
    model's allocations): one graph of every MoE layer's two GEMVs, replayed back to back, with
    each layer's ids from its router on a random input (scattered, as real routes) or fixed
    0..k-1, and with the fused router in front (no difference in the seventy-fourth pass, as in
    ``bench_expert_tlb.py`` on tensors of its own)."""
    from laguna_dflash.kernels import moe_gemv, moe_routing

    layers = moe_layers(llm.engine.target)
    if not layers:
        print("\n(no folded MoE layers: --moe-only has nothing to time)")
        return
    reset_graphs(llm)  # the engine's graph pools: room for this graph (40 layers on an H100)
    gc.collect()
    torch.cuda.empty_cache()
    dev, dt = layers[0].gate.weight.device, layers[0].gate.weight.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn((1, m.gate.weight.shape[1]), generator=gen, device=dev, dtype=dt) for m in layers]

    def route(m, x):
        return moe_routing.fused_router_route(
            x, m.gate.weight, m.e_score_correction_bias, m.top_k, m.logit_softcapping, m.score_func,
            m.norm_topk_prob, scale=m.routed_scaling_factor, num_shared=1)

    routed = [route(m, x) for m, x in zip(layers, xs)]
    fixed = [(w, ablations.fixed_routes(x, m.num_experts, m.top_k, 1)[1])
             for (w, _), m, x in zip(routed, layers, xs)]
    scattered = sum(int(ids[0, : m.top_k].max()) - int(ids[0, : m.top_k].min()) for (_, ids), m in zip(routed, layers))
    print(f"\n## the expert GEMVs alone on the engine's tensors ({len(layers)} layers; router ids span "
          f"{scattered / len(layers):.0f} experts a layer on average)\n")
    print("| ids | us a replay | us a layer |\n|---|---:|---:|")
    for label, with_router, table in (("the router's (random inputs)", False, routed),
                                      ("fixed 0..k-1", False, fixed),
                                      ("the router in front, its ids", True, None)):
        def forward(with_router: bool = with_router, table: list | None = table) -> None:
            for i, (m, x) in enumerate(zip(layers, xs)):
                w, ids = route(m, x) if with_router else table[i]
                moe_gemv.moe_gemv_experts(x, ids, w, *m.fused_experts())
        for _ in range(2):
            forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        ms = replay_ms(graph, reps)
        print(f"| {label} | {ms * 1e3:.1f} | {ms * 1e3 / len(layers):.2f} |")
        del graph


def rows(llm: LLM, prompt: list[int], args, floor_ms: float) -> None:
    """The defaults' row, then each switch's and each ablation's, at ``args.context``."""
    reference = report("defaults", llm, prompt, args, floor_ms)
    for text in args.switch:
        saved = []
        for part in text.split(";"):
            obj, name, value = parse_switch(part)
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        reset_graphs(llm)
        try:
            report(text, llm, prompt, args, floor_ms, reference)
        except Exception as e:  # noqa: BLE001 - a broken switch must not lose the other rows
            print(f"\n## {text}\n\nfailed: {type(e).__name__}: {e}")
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        reset_graphs(llm)
    for spec in args.ablate:
        undo = ablations.apply(spec)
        reset_graphs(llm)
        try:
            report(f"ablate {spec}", llm, prompt, args, floor_ms, reference)
        except Exception as e:  # noqa: BLE001 - print what failed, keep the rows before it
            print(f"\n## ablate {spec}\n\nfailed: {type(e).__name__}: {e}")
        undo()
        reset_graphs(llm)


if __name__ == "__main__":
    main()
