"""Top-p filtering alone: the bisection kernel (kernels/top_p.py) against the sort it replaced.

Baseline, in the same process on the same probabilities: the full-vocabulary sort + cumsum +
scatter that ``filtered_probs_rows`` ran until this benchmark's commit (kept here as it was),
and the sort-based reference of the new definition (ties at the boundary kept; the CPU path).
Each variant runs eagerly, as the engine's sampler does: wall time per call including the
launches, the device synchronised after each call, median of ``--iters``. Every kernel config
is checked to keep the reference's set before it is timed.

    python benchmarks/bench_top_p.py                                   # H200: V = 100352
    python benchmarks/bench_top_p.py --configs 1024,8,8 2048,8,8 1024,16,8 1024,4,4
    python benchmarks/bench_top_p.py --device cpu --vocab 4096 --rows 1,4 --iters 3  # wiring

Rows: ``--rows`` (a sampled batch times the rows a request: 1 at decode, K + 1 at a verify).
Shapes: ``flat`` (softmax of N(0, 1) logits: random weights, ~95% of the vocabulary kept at top_p
0.95) and ``peaked`` (N(0, 1) x 8: a trained model's shape, a few hundred tokens kept).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from laguna_dflash.kernels import top_p as tp


def sort_scatter_top_p(probs: torch.Tensor, bound: float) -> torch.Tensor:
    """The top-p filter ``filtered_probs_rows`` ran before the kernel (baseline)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= bound
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def wall_us(fn, iters: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def probabilities(shape: str, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g, device=device)
    if shape == "peaked":
        logits *= 8.0
    # bf16 logits, as the engine's (ties at many levels), widened: the sampler's input
    return torch.softmax(logits.bfloat16().float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=100352)
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--bound", type=float, default=0.95)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--configs", nargs="*", default=[],
                    help="extra kernel configs CHUNK,SUB,NUM_WARPS (the module's default always runs)")
    args = ap.parse_args()
    device = torch.device(args.device)
    default = (tp.CHUNK, tp.SUB, tp.NUM_WARPS)
    configs = [default] + [tuple(int(x) for x in c.split(",")) for c in args.configs
                           if tuple(int(x) for x in c.split(",")) != default]
    kernel = tp.can_use(torch.empty(1, 1, device=device))
    header = ["shape", "rows", "kept", "old sort us", "reference us"]
    header += [f"kernel {c},{s},{w} us" for c, s, w in configs] if kernel else []
    header += ["old / kernel"] if kernel else []
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"V = {args.vocab}, top_p = {args.bound}, median of {args.iters} eager calls")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(header) - 2))
    for shape in ("flat", "peaked"):
        for rows in (int(r) for r in args.rows.split(",")):
            probs = probabilities(shape, rows, args.vocab, device)
            want = tp.top_p_filter_reference(probs, args.bound)
            cells = [shape, str(rows), f"{(want > 0).sum(-1).float().mean().item():.0f}",
                     f"{wall_us(lambda p=probs: sort_scatter_top_p(p, args.bound), args.iters, device):.1f}",
                     f"{wall_us(lambda p=probs: tp.top_p_filter_reference(p, args.bound), args.iters, device):.1f}"]
            kernel_us = []
            for chunk, sub, warps in configs if kernel else ():
                tp.CHUNK, tp.SUB, tp.NUM_WARPS = chunk, sub, warps
                got = tp.top_p_filter_(probs.clone(), args.bound)
                if not torch.equal(got > 0, want > 0):
                    cells.append(f"set differs ({int(((got > 0) != (want > 0)).sum())} tokens)")
                    continue
                scratch = probs.clone()
                kernel_us.append(wall_us(lambda s=scratch, p=probs: tp.top_p_filter_(s.copy_(p), args.bound),
                                         args.iters, device)
                                 - wall_us(lambda s=scratch, p=probs: s.copy_(p), args.iters, device))
                cells.append(f"{kernel_us[-1]:.1f}")
            tp.CHUNK, tp.SUB, tp.NUM_WARPS = default
            if kernel and kernel_us:
                cells.append(f"{float(cells[3]) / kernel_us[0]:.1f}x")
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
