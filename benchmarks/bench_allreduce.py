"""What a tensor-parallel decode step pays for its all-reduces: latency per all-reduce of a
``[T, hidden]`` activation block, NCCL through ``torch.distributed`` inside a CUDA graph (as the
engine's graphs replay them), per token count T.

A Laguna layer adds two all-reduces per forward (after ``o_proj`` and after the MLP/MoE), so a
40-layer XS-2.1 step has 80 plus the embedding's one; the table's last column is that count times
the per-op latency, to hold against the 2.26 ms batch-1 step of one GPU::

    torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py              # GPUs, NCCL, graphs
    torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py --device cpu # wiring check (gloo)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def time_ops(x: torch.Tensor, num_ops: int, repeats: int, use_graph: bool) -> float:
    """Median seconds per all-reduce over ``repeats`` runs of ``num_ops`` in-place all-reduces
    of ``x`` (captured once in a CUDA graph with ``use_graph``)."""
    def run() -> None:
        for _ in range(num_ops):
            dist.all_reduce(x)

    run()  # warm-up: NCCL's communicator and buffers
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
        run()
    times = []
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / num_ops)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,64", help="rows T of the [T, hidden] blocks")
    ap.add_argument("--hidden", type=int, default=2048, help="2048: XS-2.1; 3072: S-2.1")
    ap.add_argument("--ops-per-step", type=int, default=81, help="all-reduces a forward makes")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        # zeros stay zeros under repeated sums: no overflow whatever the op count
        x = torch.zeros(t, args.hidden, dtype=torch.bfloat16 if on_gpu else torch.float32,
                        device=args.device)
        seconds = time_ops(x, args.ops_per_step, args.repeats, use_graph=on_gpu)
        rows.append((t, seconds))
    check = torch.full((4,), float(rank + 1), device=args.device)
    dist.all_reduce(check)
    assert torch.all(check == world * (world + 1) / 2), check  # the sums are right
    if rank == 0:
        name = torch.cuda.get_device_name() if on_gpu else "cpu"
        print(f"# {name} x {world}, {'NCCL in a CUDA graph' if on_gpu else 'gloo, eager'}, "
              f"hidden {args.hidden}, {args.ops_per_step} all-reduces a forward")
        print("| T | us per all-reduce | ms per forward |")
        print("|---:|---:|---:|")
        for t, seconds in rows:
            print(f"| {t} | {seconds * 1e6:.1f} | {seconds * args.ops_per_step * 1e3:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
