"""Greedy tokens at the lm_head: the bf16 GEMM + argmax against the int8 copy with exact bounds.

At Laguna-XS-2.1's lm_head shape (100352 x 2048, random Gaussian weights and activations),
times each path's CUDA graph replay (one call a graph, best of ``--rounds`` means of
``--iters`` replays; the weights are far larger than L2, so every replay streams them from HBM)
and prints the tokens' agreement with a float64 reference:

* ``bf16 GEMM + argmax``: ``lm_head_linear`` (the engine's skinny GEMM config) then
  ``argmax_rows``: what the engine runs today;
* ``int8 GEMM alone``: the first launch of the other path;
* ``int8 + exact``: ``greedy_lm_head.greedy_tokens`` (kernels/greedy_lm_head.py), once per
  ``--exact-chunks`` value (the exact pass's tokens a program, ``EXACT_CHUNK``; the first is the
  tokens' column).

``candidates`` gives the tokens whose bf16 rows the exact pass reads, per row
(``candidates_reference``), and the most in one exact chunk of each size.

    python benchmarks/bench_greedy_lm_head.py --m 1,4
    python benchmarks/bench_greedy_lm_head.py --m 1,4 --exact-chunks 2048,512,256
    python benchmarks/bench_greedy_lm_head.py --m 1 --overrides '{"int8,1,100352,2048": {"use_dot": true}}'

``--overrides``: a ``skinny_gemm.CONFIG_OVERRIDES`` JSON for this run (the int8 copy's GEMM takes
the ``"int8,M_BUCKET,N,K"`` entries).
    TRITON_INTERPRET=1 python benchmarks/bench_greedy_lm_head.py --device cpu --vocab 3000 --hidden 64  # wiring

On the CPU (under Triton's interpreter) nothing is timed: the table gives the tokens only.
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--exact-chunks", default=str(glh.EXACT_CHUNK),
                    help="EXACT_CHUNK values to time (comma list of powers of two)")
    ap.add_argument("--overrides", default="", help="skinny_gemm.CONFIG_OVERRIDES as JSON (module docstring)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="the int8 path's bounds, exact and finish as plain launches (greedy_lm_head.USE_PDL)")
    args = ap.parse_args()
    glh.USE_PDL = not args.no_pdl
    if args.overrides:
        sg.CONFIG_OVERRIDES.update(json.loads(args.overrides))
    chunks = [int(v) for v in args.exact_chunks.split(",") if v]
    if not chunks or any(c < 16 or c & (c - 1) for c in chunks):
        ap.error(f"--exact-chunks must be powers of two >= 16, got {args.exact_chunks!r}")
    dev = torch.device(args.device)
    timed = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    head = glh.quantize(w)
    name = torch.cuda.get_device_name() if timed else "CPU (not timed)"
    print(f"{name}, torch {torch.__version__}, lm_head {args.vocab} x {args.hidden} "
          f"bf16 ({w.numel() * 2 / 1e6:.0f} MB; int8 copy and bounds {head.nbytes / 1e6:.0f} MB)"
          f"{', overrides ' + args.overrides if args.overrides else ''}"
          f"{', plain launches after the int8 GEMM' if args.no_pdl else ''}\n")
    chunk_cols = "".join(f" int8 + exact ({c}) us |" for c in chunks)
    print(f"| rows | bf16 GEMM + argmax us | int8 GEMM alone us |{chunk_cols} ratio | tokens = bf16 path's "
          "| = float64 argmax | candidates a row | most in one chunk |")
    print("|---:|---:|---:|" + "---:|" * len(chunks) + "---:|---:|---:|---|---|")
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, args.hidden, generator=g, device=dev).to(torch.bfloat16)
        base = int8 = float("nan")
        fast = {c: float("nan") for c in chunks}
        if timed:
            base = graph_us(lambda x=x: argmax_rows(lm_head_linear(x, w)), args.iters, args.rounds)
            cfg = sg.default_config(m, args.vocab, args.hidden, int8=True)
            int8 = graph_us(lambda x=x, cfg=cfg: sg.skinny_gemm(x, head.q, cfg, scale=head.scale), args.iters,
                            args.rounds)
        want = argmax_rows(lm_head_linear(x, w))
        ref = glh.greedy_tokens_reference(x, w)
        same = []
        for c in chunks:
            glh.EXACT_CHUNK = c
            if timed:
                fast[c] = graph_us(lambda x=x: glh.greedy_tokens(x, w, head), args.iters, args.rounds)
            got = glh.greedy_tokens(x, w, head)
            same.append((int((got == want).sum()), int((got == ref).sum())))
        glh.EXACT_CHUNK = chunks[0]
        mask = glh.candidates_reference(x, head)
        most = []
        for c in chunks:
            pad = -mask.shape[1] % c
            most.append(int(torch.nn.functional.pad(mask.int(), (0, pad)).view(m, -1, c).sum(-1).max()))
        times = "".join(f" {fast[c]:.1f} |" for c in chunks)
        tokens = " / ".join(f"{a} of {m}" for a, _ in same)
        exact = " / ".join(f"{b} of {m}" for _, b in same)
        print(f"| {m} | {base:.1f} | {int8:.1f} |{times} {fast[chunks[0]] / base:.2f} | {tokens} | {exact} | "
              f"{', '.join(str(int(n)) for n in mask.sum(dim=1).tolist())} | "
              f"{', '.join(f'{n} ({c})' for n, c in zip(most, chunks))} |")


if __name__ == "__main__":
    main()
