"""Are the batch-1 expert GEMVs slower when a step's experts differ from the step before's?

The seventy-third pass found (``profile_decode_xs.py --ablate``, H100) that the decode graph's
MoE GEMVs run about twice as fast whenever every layer's expert ids are the same at every step
(fixed, spread over the experts, or the router's real ids recorded once), and only ~10% slower
when they move to other experts at every call in groups of k contiguous ones, against the
router's fresh scattered ids every step. Same bytes either way. This script isolates that
without the engine: ``--layers`` MoE layers at XS-2.1 shapes (``gate_up [E + 1, 2I, H]``,
``down [E + 1, H, I]``, bf16, the shared expert folded in as id E), one CUDA graph of their
``moe_gemv_experts`` calls reading ids from a static buffer a layer, timed a replay at a time
(CUDA events) after an L2 flush, with the ids before each replay:

* ``fixed``: the same random ids at every replay;
* ``fresh``: new random distinct ids (copied in before the timing);
* ``fresh, touched``: the same, then, before the timing, one 2-byte load every ``--touch-kb`` KiB
  of each newly chosen expert's gate_up and down (1-2 sectors a page: the L2 barely changes, the
  address translations of those pages are made);
* ``fresh, contiguous``: k - 1 contiguous experts at a new random place;
* ``fixed, 0..k-1 in every layer``: ids 0..k-2 and the shared one in every layer at every replay
  (what ``profile_decode_xs.py --ablate routing`` gives every layer).

If ``fresh`` is slow and ``fresh, touched`` as fast as ``fixed``, the cost is the translation of
pages not used the step before (the GPU's TLBs), not the reads.

``--router`` adds two rows with the engine's chain a layer, the fused router (one launch, PDL) on
the layer's input and then the two expert GEMVs, each replay on a fresh random input:

* ``router``: the GEMVs read the router's ids (as the engine does);
* ``router, ids dropped``: the router runs, the GEMVs read the static fixed ids.

    python benchmarks/bench_expert_tlb.py                  # 39 layers, 30 replays a row
    python benchmarks/bench_expert_tlb.py --layers 8 --reps 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from laguna_dflash.kernels.moe_gemv import moe_gemv_experts  # noqa: E402
from laguna_dflash.kernels.moe_routing import fused_router_route  # noqa: E402

MODES = ("fixed", "fresh", "fresh, touched", "fresh, contiguous", "fixed, 0..k-1 in every layer")


def choose_ids(mode: str, num_experts: int, num_routed: int, generator: torch.Generator) -> torch.Tensor:
    """``[1, num_routed + 1]`` int64: routed ids in ``[0, num_experts)``, distinct, then the
    shared expert's id ``num_experts``. ``fresh, contiguous``: a run of ``num_routed`` ids."""
    if mode == "fixed, 0..k-1 in every layer":
        routed = torch.arange(num_routed)
    elif mode == "fresh, contiguous":
        start = int(torch.randint(0, num_experts - num_routed + 1, (1,), generator=generator))
        routed = torch.arange(start, start + num_routed)
    else:
        routed = torch.randperm(num_experts, generator=generator)[:num_routed]
    return torch.cat([routed, torch.tensor([num_experts])]).view(1, -1)


def touch_offsets(ids: torch.Tensor, expert_numel: int, stride: int, num_experts: int) -> torch.Tensor:
    """Flat element offsets of one element every ``stride`` elements of each routed expert's
    block in a ``[E + 1, ...]`` tensor whose experts hold ``expert_numel`` elements each."""
    routed = ids.view(-1)
    routed = routed[routed < num_experts]
    within = torch.arange(0, expert_numel, stride)
    return (routed[:, None] * expert_numel + within[None, :]).reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=39, help="MoE layers (XS-2.1 has 39)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512, help="expert intermediate size")
    ap.add_argument("--top-k", type=int, default=8, help="routed experts a token (the shared one is added)")
    ap.add_argument("--reps", type=int, default=30, help="timed replays a row")
    ap.add_argument("--touch-kb", type=int, default=64, help="KiB between touched elements")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router", action="store_true", help="also the router -> GEMVs rows")
    ap.add_argument("--back-to-back", action="store_true",
                    help="no L2 flush and no host sync between replays: --reps replays queued with "
                         "their id copies between them, timed together (as profile_decode_xs.py "
                         "replays a graph); the touched row is skipped")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_tlb.py needs a CUDA device (it times CUDA-graph replays)")
    if not 1 <= args.top_k <= args.experts:
        raise SystemExit(f"--top-k must be in 1..--experts ({args.experts}), got {args.top_k}")
    dev, dt = torch.device("cuda"), torch.bfloat16
    e, h, i = args.experts, args.hidden, args.inter
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    gate_ups = [torch.empty((e + 1, 2 * i, h), device=dev, dtype=dt).normal_(0, 0.02) for _ in range(args.layers)]
    downs = [torch.empty((e + 1, h, i), device=dev, dtype=dt).normal_(0, 0.02) for _ in range(args.layers)]
    ids = [choose_ids("fixed", e, args.top_k, gen).to(dev) for _ in range(args.layers)]
    weights = torch.full((1, args.top_k + 1), 1.0 / (args.top_k + 1), device=dev, dtype=dt)
    x = torch.randn((1, h), device=dev, dtype=dt)
    flush = torch.empty(256 * 2**20, device=dev, dtype=torch.uint8)  # 256 MiB: more than any L2
    gib = sum(t.numel() * t.element_size() for t in gate_ups + downs) / 2**30
    mb_read = args.layers * (args.top_k + 1) * 3 * h * i * 2 / 1e6
    print(f"{args.layers} layers, {gib:.1f} GiB of experts, {mb_read:.0f} MB read a replay, "
          f"{torch.cuda.get_device_name()}")

    routers = [torch.empty((e, h), device=dev, dtype=dt).normal_(0, 0.02) for _ in range(args.layers)]
    bias = torch.zeros(e, device=dev, dtype=torch.float32)

    def forward(router: str) -> None:
        # router "": the ids buffers; "use": the router's ids; "drop": the router runs, its ids unused
        out = x
        for layer in range(args.layers):  # each layer's input is the last one's first pair
            layer_ids, layer_w = ids[layer], weights
            if router:
                rw, rids = fused_router_route(out, routers[layer], bias, args.top_k, 0.0, "sigmoid", True,
                                              scale=2.5, num_shared=1)
                if router == "use":
                    layer_ids, layer_w = rids, rw
            out = moe_gemv_experts(out, layer_ids, layer_w, gate_ups[layer], downs[layer])[:, 0]

    def capture(router: str) -> torch.cuda.CUDAGraph:
        for _ in range(2):  # builds, then a clean run
            forward(router)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(router)
        return graph

    graph = capture("")
    fixed = [t.clone() for t in ids]
    stride = args.touch_kb * 512  # bf16 elements between touched ones
    rows = []
    modes = MODES + (("router", "router, ids dropped") if args.router else ())
    for mode in modes:
        if mode.startswith("router"):
            graph = capture("use" if mode == "router" else "drop")
        times = []
        if args.back_to_back:
            if mode == "fresh, touched":
                continue
            staged = [[(fixed[layer] if mode in ("fixed", "router", "router, ids dropped")
                        else choose_ids(mode, e, args.top_k, gen).to(dev)) for layer in range(args.layers)]
                      for _ in range(args.reps + 1)]
            inputs = [torch.randn((1, h), generator=gen).to(dev, dt) for _ in range(args.reps + 1)]
            for rep in range(args.reps + 1):  # staged ids and inputs copied in on the device
                for layer in range(args.layers):
                    ids[layer].copy_(staged[rep][layer])
                if mode.startswith("router"):
                    x.copy_(inputs[rep])
                if rep == 0:
                    graph.replay()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                else:
                    graph.replay()
            end.record()
            end.synchronize()
            per = start.elapsed_time(end) * 1e3 / args.reps  # includes each replay's id copies
            rows.append((mode, per, per))
            continue
        for rep in range(args.reps + 2):
            if mode == "fixed, 0..k-1 in every layer":
                for layer in range(args.layers):
                    ids[layer].copy_(choose_ids(mode, e, args.top_k, gen))
            elif mode == "fixed" or mode.startswith("router"):
                for layer in range(args.layers):
                    ids[layer].copy_(fixed[layer])
                if mode.startswith("router"):  # fresh routes: a fresh input
                    x.copy_(torch.randn((1, h), generator=gen).to(dt))
            else:
                for layer in range(args.layers):
                    ids[layer].copy_(choose_ids(mode, e, args.top_k, gen))
            flush.zero_()
            if mode == "fresh, touched":
                sink = torch.zeros((), device=dev, dtype=torch.float32)
                for layer in range(args.layers):
                    host_ids = ids[layer].cpu()
                    for t, numel in ((gate_ups[layer], 2 * i * h), (downs[layer], h * i)):
                        offs = touch_offsets(host_ids, numel, stride, e).to(dev)
                        sink += t.view(-1).index_select(0, offs).float().sum()
                sink.item()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if rep >= 2:
                times.append(start.elapsed_time(end) * 1e3)
        rows.append((mode, statistics.median(times), min(times)))
    print("\n| ids before each replay | median us a replay | min | us a layer (median) | x fixed |")
    print("|---|---:|---:|---:|---:|")
    base = rows[0][1]
    for mode, med, low in rows:
        print(f"| {mode} | {med:.1f} | {low:.1f} | {med / args.layers:.2f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
