"""Do the two batch-invariant MoE kernels give the same bits? (fused_moe vs grouped_moe, GPU)

``batch_invariant.moe_kernel`` picks one of two kernel pairs, each batch-invariant on its own:
the fused kernels (kernels/fused_moe.py; fast at decode) and the sorted grouped kernels
(kernels/grouped_moe.py; fast at prefill). Both compute a 16-pair tile with the same jit helpers
(``fused_moe._gate_up_tile`` / ``_down_tile``: K in order, no split), so each pair's output may
well be bitwise the same in both, whatever their other tile constants; if it is, an engine could
take the fused kernels for decode-phase forwards and the sorted ones for prefill and stay
batch-invariant. This measures it at Laguna-XS-2.1 MoE shapes (bf16, random weights): per token
count, the share of pairs whose ``[H]`` outputs are bitwise equal and the largest difference,
with the grouped kernels' own tile constants and with the fused kernels' constants; then each
pair's time per token count (CUDA events, the median of ``--reps``), which places
``batch_invariant.MOE_FUSED_MAX_TOKENS`` (the "auto" switch from fused to sorted).

    python benchmarks/check_moe_kernels_agree.py            # H200
"""

from __future__ import annotations

import argparse
import functools

import torch

from laguna_dflash.kernels import batch_invariant, fused_moe, grouped_moe


def inputs(t: int, hidden: int, inter: int, experts: int, top_k: int, seed: int) -> tuple:
    """(x, ids, weights, gate_up, down) at Laguna-XS-2.1 MoE shapes, bf16 on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, hidden, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    ids = torch.rand(t, experts, device="cuda", generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.rand(t, top_k, device="cuda", generator=g)
    return x, ids, weights, gate_up, down


def median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def compare(t: int, hidden: int, inter: int, experts: int, top_k: int, seed: int) -> tuple[float, float]:
    """(share of pairs bitwise equal, max |fused - sorted|) at ``t`` tokens."""
    x, ids, weights, gate_up, down = inputs(t, hidden, inter, experts, top_k, seed)
    fused = batch_invariant._fused_experts(x, ids, weights, gate_up, down)
    ours = grouped_moe.sorted_moe_experts(x, ids, weights, gate_up, down,
                                          block_m=batch_invariant.MOE_BLOCK_M)
    equal = (fused == ours).all(dim=-1).float().mean().item()
    return equal, (fused.float() - ours.float()).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1,4,16,64,256,300")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=257, help="routed + the folded shared expert")
    ap.add_argument("--top-k", type=int, default=9)
    ap.add_argument("--time-tokens", default="1,8,16,32,48,64,96,128,256,1024",
                    help="token counts timed ('' skips the timing)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: the question is what the GPU's MMA rounds")
    own = (grouped_moe._GATE_UP_CFG, grouped_moe._DOWN_CFG)
    print("| grouped tile constants | T | pairs bitwise equal | max abs diff |\n|---|---:|---:|---:|")
    for label, cfgs in (("its own", own), ("fused_moe's", (fused_moe._GATE_UP_CFG, fused_moe._DOWN_CFG))):
        grouped_moe._GATE_UP_CFG, grouped_moe._DOWN_CFG = cfgs
        for t in (int(v) for v in args.tokens.split(",")):
            equal, diff = compare(t, args.hidden, args.inter, args.experts, args.top_k, seed=t)
            print(f"| {label} {cfgs} | {t} | {equal:.1%} | {diff:.3g} |")
    grouped_moe._GATE_UP_CFG, grouped_moe._DOWN_CFG = own
    if not args.time_tokens:
        return
    print(f"\n| T | fused ms | sorted ms | sorted / fused | \"auto\" (switch above "
          f"{batch_invariant.MOE_FUSED_MAX_TOKENS}) |\n|---:|---:|---:|---:|---|")
    for t in (int(v) for v in args.time_tokens.split(",")):
        case = inputs(t, args.hidden, args.inter, args.experts, args.top_k, seed=t)
        fused = median_ms(functools.partial(batch_invariant._fused_experts, *case), args.reps)
        ours = median_ms(functools.partial(grouped_moe.sorted_moe_experts, *case,
                                           block_m=batch_invariant.MOE_BLOCK_M), args.reps)
        pick = "fused" if t <= batch_invariant.MOE_FUSED_MAX_TOKENS else "sorted"
        print(f"| {t} | {fused:.3f} | {ours:.3f} | {ours / fused:.2f} | {pick} |")


if __name__ == "__main__":
    main()
