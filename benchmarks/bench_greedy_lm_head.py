"""Greedy tokens at the lm_head: the bf16 GEMM + argmax against the int8 copy with exact bounds.

At Laguna-XS-2.1's lm_head shape (100352 x 2048, random Gaussian weights and activations),
times each path's CUDA graph replay (one call a graph, best of ``--rounds`` means of
``--iters`` replays; the weights are far larger than L2, so every replay streams them from HBM)
and prints the tokens' agreement with a float64 reference:

* ``bf16 GEMM + argmax``: ``lm_head_linear`` (the engine's skinny GEMM config) then
  ``argmax_rows``: what the engine runs today;
* ``int8 GEMM alone``: the first launch of the other path;
* ``int8 + exact``: ``greedy_lm_head.greedy_tokens`` (kernels/greedy_lm_head.py).

    python benchmarks/bench_greedy_lm_head.py --m 1,4
    TRITON_INTERPRET=1 python benchmarks/bench_greedy_lm_head.py --device cpu --vocab 3000 --hidden 64  # wiring

On the CPU (under Triton's interpreter) nothing is timed: the table gives the tokens only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels import greedy_lm_head as glh  # noqa: E402
from laguna_dflash.kernels import skinny_gemm as sg  # noqa: E402
from laguna_dflash.kernels.argmax import argmax_rows  # noqa: E402
from laguna_dflash.models.layers import lm_head_linear  # noqa: E402


def graph_us(fn, iters: int, rounds: int) -> float:
    """Best of ``rounds`` means of ``iters`` replays of ``fn``'s CUDA graph, in us."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,4", help="rows of x (comma list, each <= 16)")
    ap.add_argument("--vocab", type=int, default=100352)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    timed = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    head = glh.quantize(w)
    name = torch.cuda.get_device_name() if timed else "CPU (not timed)"
    print(f"{name}, torch {torch.__version__}, lm_head {args.vocab} x {args.hidden} "
          f"bf16 ({w.numel() * 2 / 1e6:.0f} MB; int8 copy and bounds {head.nbytes / 1e6:.0f} MB)\n")
    print("| rows | bf16 GEMM + argmax us | int8 GEMM alone us | int8 + exact us | ratio | tokens = bf16 path's "
          "| = float64 argmax |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, args.hidden, generator=g, device=dev).to(torch.bfloat16)
        base = int8 = fast = float("nan")
        if timed:
            base = graph_us(lambda x=x: argmax_rows(lm_head_linear(x, w)), args.iters, args.rounds)
            cfg = sg.default_config(m, args.vocab, args.hidden, fp8=True)
            int8 = graph_us(lambda x=x, cfg=cfg: sg.skinny_gemm(x, head.q, cfg, scale=head.scale), args.iters,
                            args.rounds)
            fast = graph_us(lambda x=x: glh.greedy_tokens(x, w, head), args.iters, args.rounds)
        want = argmax_rows(lm_head_linear(x, w))
        got = glh.greedy_tokens(x, w, head)
        ref = glh.greedy_tokens_reference(x, w)
        print(f"| {m} | {base:.1f} | {int8:.1f} | {fast:.1f} | {fast / base:.2f} | "
              f"{int((got == want).sum())} of {m} | {int((got == ref).sum())} of {m} |")


if __name__ == "__main__":
    main()
