"""Whether the verify's per-pair expert GEMVs pay HBM bytes for an expert two tokens share.

At 2-4 tokens (a K = 1-3 verify) ``MoE`` runs ``kernels/moe_gemv.py``, which reads each (token,
expert) pair's weights: at 4 tokens the folded shared expert 4 times, and a routed expert twice
wherever two tokens pick it (~2.3 a layer on the dummy weights' routing: 29.7 distinct of 32,
docs/PERFORMANCE.md, fifty-third pass). Whether those repeats come from HBM or from L2 (the
pairs of one tile run side by side, but the weights load ``evict_first``) decides what reading
each distinct expert once could save the verify. This times one layer's experts at
Laguna-XS-2.1 shapes (``moe_gemv_experts``, 4 tokens x 9 pairs, CUDA-graph replays rotated over
``--sets`` id draws, so a replay does not find the previous one's weights in L2) for id layouts
with the same 36 pairs:

* ``distinct``: 36 different experts (every pair's bytes are its own);
* ``verify``: each token 8 distinct routed experts drawn independently, plus the shared one;
* ``verify, shared once``: the same routed draws, each token's shared pair replaced by an expert
  no other pair reads (the repeats left: the routed ones);
* ``shared by all``: the 4 tokens route to the same 8 experts (9 distinct with the shared).

If repeats cost nothing, a layout's time follows its distinct experts' bytes; if they come from
HBM, every layout takes the ``distinct`` time. (On an H100, eighty-fifth pass: ``verify`` took
72.6 us against 81.6 for ``distinct``, so the repeats come mostly from L2; the two switches this
compared, the default L2 policy for repeated experts' tiles and an expert's first pair computing
all of its pairs, were slower and are removed.)

    python benchmarks/bench_moe_duplicates.py
"""

from __future__ import annotations

import argparse

import torch
from bench_gpu_xs import copy_bandwidth

from laguna_dflash.kernels.moe_gemv import moe_gemv_experts

HIDDEN, INTER, ROUTED, TOP_K, TOKENS = 2048, 512, 256, 8, 4  # ROUTED + 1 experts: the folded shared one


def draws(layout: str, sets: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``sets`` id tensors ``[TOKENS, TOP_K + 1]`` of one layout (module docstring). Each draw
    plays the shared expert with another expert id, as each layer has its own: a fixed one
    would stay in L2 from one replay to the next where its loads keep the default policy."""
    out = []
    for _ in range(sets):
        order = torch.randperm(ROUTED + 1, generator=gen)
        shared, pool = int(order[0]), order[1:]  # this draw's shared expert, the routed ones
        if layout == "distinct":
            ids = order[: TOKENS * (TOP_K + 1)].view(TOKENS, TOP_K + 1)
        elif layout == "shared by all":
            row = torch.cat([pool[:TOP_K], torch.tensor([shared])])
            ids = row.repeat(TOKENS, 1)
        else:
            routed = torch.stack([pool[torch.randperm(ROUTED, generator=gen)[:TOP_K]] for _ in range(TOKENS)])
            if layout == "verify":
                last = torch.full((TOKENS, 1), shared)
            else:  # "verify, shared once": each token's last pair an expert nobody else reads
                taken = set(routed.flatten().tolist())
                last = torch.tensor([e for e in pool.tolist() if e not in taken][:TOKENS]).view(TOKENS, 1)
            ids = torch.cat([routed, last], dim=1)
        out.append(ids.to(torch.int32))
    return out


def time_layout(ids_sets: list[torch.Tensor], x, w, gate_up, down, replays: int) -> tuple[float, float]:
    """(us a layer: the median of 5 timings of ``replays`` rotated replays, mean distinct experts)."""
    graphs, keep = [], []
    for ids in ids_sets:
        ids = ids.cuda()
        moe_gemv_experts(x, ids, w, gate_up, down)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            keep.append(moe_gemv_experts(x, ids, w, gate_up, down))
        graphs.append(g)
        keep.append(ids)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(replays):
            graphs[i % len(graphs)].replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end) / replays)
    distinct = sum(len(set(ids.flatten().tolist())) for ids in ids_sets) / len(ids_sets)
    return sorted(times)[2], distinct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", type=int, default=16, help="id draws a layout, replayed in turn")
    ap.add_argument("--replays", type=int, default=400)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    bandwidth = copy_bandwidth(dev)  # before the weights take their memory
    gate_up = (torch.randn(ROUTED + 1, 2 * INTER, HIDDEN, device=dev) * HIDDEN**-0.5).to(dtype)
    down = (torch.randn(ROUTED + 1, HIDDEN, INTER, device=dev) * INTER**-0.5).to(dtype)
    x = torch.randn(TOKENS, HIDDEN, device=dev).to(dtype)
    w = torch.rand(TOKENS, TOP_K + 1, device=dev)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"{TOKENS} tokens x {TOP_K + 1} pairs, {expert_bytes / 1e6:.2f} MB an expert\n")
    print("| layout | distinct experts | us a layer | distinct bytes' floor us | pair bytes' floor us | "
          "TB/s on distinct bytes |\n|---|---:|---:|---:|---:|---:|")
    pairs = TOKENS * (TOP_K + 1)
    for layout in ("distinct", "verify", "verify, shared once", "shared by all"):
        sets = draws(layout, args.sets, gen)
        us, distinct = time_layout(sets, x, w, gate_up, down, args.replays)
        floor_distinct = 1e6 * distinct * expert_bytes / bandwidth
        floor_pairs = 1e6 * pairs * expert_bytes / bandwidth
        print(f"| {layout} | {distinct:.1f} | {us:.1f} | {floor_distinct:.1f} | {floor_pairs:.1f} | {distinct * expert_bytes / us / 1e6:.2f} |")


if __name__ == "__main__":
    main()
