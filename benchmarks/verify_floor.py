"""How many experts a verify reads, and what that makes the DFlash step's bandwidth floor.

A batch-1 decode step reads ``top_k`` routed experts (plus the shared one) per MoE layer; a
verify of ``K + 1`` tokens reads the union of its tokens' choices, so its floor is not ``K + 1``
times anything simple. This measures the union on the engine's own routing (dummy weights, as
every GPU benchmark here uses; ``MoE.route`` recorded during a prefill of a seeded random
prompt: windows of ``w`` consecutive tokens stand for a verify of ``w`` tokens), prints it
against the uniform-routing expectation ``E (1 - (1 - k/E)^w)``, then the bandwidth floors
(bytes / ``--bandwidth``) of the XS-2.1-size decode step, the ``K``-draft verify, the drafter
block, and what L = K + 1 tokens a step would give over target-only if the DFlash step and the
decode step ran at the same multiple of their floors.

    python benchmarks/verify_floor.py                      # CPU: 3 layers at XS-2.1 widths, ~1 min
    python benchmarks/verify_floor.py --bandwidth 4.27e12  # the H200's measured copy rate

Counting only: no kernel is timed here. The byte counts are those of ``bench_gpu_xs.active_bytes``
(weights except the embedding, KV of the visible context) with the expert share replaced by the
union measured here.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from bench_gpu_xs import xs_draft_config, xs_target_config

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.models.layers import MoE
from laguna_dflash.models.registry import resolve_architecture


def mean_union(ids: torch.Tensor, width: int) -> float:
    """``ids [T, k]`` expert ids of T consecutive tokens -> mean number of distinct ids over the
    ``T - width + 1`` windows of ``width`` consecutive tokens."""
    windows = ids.unfold(0, width, 1)  # [T - w + 1, k, w]
    return sum(len(set(win.flatten().tolist())) for win in windows) / windows.shape[0]


def expected_union(num_experts: int, top_k: int, width: int) -> float:
    """Distinct experts of ``width`` tokens each choosing ``top_k`` of ``num_experts`` uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** width)


def meta_model(config: dict, **build_kwargs) -> torch.nn.Module:
    """The registered architecture of ``config`` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return resolve_architecture(config["architectures"][0]).from_config(config, {}, **build_kwargs)


def target_bytes(target: torch.nn.Module, context: int, experts_per_layer: float) -> float:
    """Bytes a target forward reads (``bench_gpu_xs.active_bytes`` with ``experts_per_layer``
    routed experts of each MoE layer instead of ``top_k``), bf16."""
    moe = target.spec.moe
    total = 0.0
    for name, p in target.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        n = p.numel() * 2
        total += n * experts_per_layer / moe.num_experts if "experts_" in name else n
    s = target.spec
    per_token = 2 * s.num_kv_heads * s.head_dim * 2
    return total + sum(per_token * (min(context, layer.sliding_window) if layer.sliding_window else context)
                       for layer in s.layers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3, help="target layers built (full XS-2.1 widths)")
    ap.add_argument("--full-layers", type=int, default=40, help="layers of the model the floors are for")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens whose routing is recorded")
    ap.add_argument("--context", type=int, default=1024, help="context of the floors' KV reads")
    ap.add_argument("--k", type=int, default=3, help="draft tokens of the DFlash step")
    ap.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (the H200's copy rate)")
    args = ap.parse_args()
    routed: list[torch.Tensor] = []
    original = MoE.route

    def recording(self, x):
        weights, ids = original(self, x)
        routed.append(ids.detach().cpu())
        return weights, ids

    MoE.route = recording
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(xs_target_config(args.layers)))
        llm = LLM(tmp, dtype="bfloat16", device="cpu", load_format="dummy", max_num_seqs=1,
                  max_model_len=args.prompt + 16)
        prompt = torch.randint(100, 100000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=1))
    MoE.route = original
    target = llm.engine.target
    moe = target.spec.moe
    prefill = [ids for ids in routed if ids.shape[0] == args.prompt]
    assert prefill, "no MoE layer routed the prompt in one forward"
    print(f"{len(prefill)} MoE layers, {moe.num_experts} experts, top-{moe.top_k}, {args.prompt}-token "
          "prompt (dummy weights, seed 0)\n")
    print("| tokens w | distinct routed experts, mean over windows and layers | uniform expectation |")
    print("|---:|---:|---:|")
    union = {}
    for w in (1, 2, 4, 8, 16):
        union[w] = sum(mean_union(ids, w) for ids in prefill) / len(prefill)
        print(f"| {w} | {union[w]:.2f} | {expected_union(moe.num_experts, moe.top_k, w):.2f} |")

    # floors at the full model, from its shapes (the meta device: no weights)
    full = meta_model(xs_target_config(args.full_layers))
    drafter = meta_model(xs_draft_config(args.full_layers), target=full)
    # the drafter's own layers (its embedding and lm_head are the target's)
    target_ids = {id(p) for p in full.parameters()}
    drafter_bytes = sum(p.numel() * 2 for p in drafter.parameters() if id(p) not in target_ids)
    lm_head = full.spec.vocab_size * full.spec.hidden_size * 2
    w = args.k + 1
    verify_union = union.get(w) or expected_union(moe.num_experts, moe.top_k, w)
    decode = target_bytes(full, args.context, union[1])
    verify = target_bytes(full, args.context, verify_union)
    num_sparse = xs_target_config(args.full_layers)["mlp_layer_types"].count("sparse")
    expert_bytes = sum(p.numel() * 2 for n, p in full.named_parameters() if "experts_" in n) / (
        moe.num_experts * num_sparse)
    step = verify + drafter_bytes + lm_head  # the drafts' logits read the shared lm_head once
    bw = args.bandwidth
    print(f"\nfloors at {args.full_layers} layers, {args.context}-token context, {bw / 1e12:.2f} TB/s "
          f"(expert {expert_bytes / 1e6:.2f} MB, verify of {w} tokens reading {verify_union:.2f} routed "
          "experts a layer):\n")
    print("| | GB | floor ms |\n|---|---:|---:|")
    for name, b in (("decode step (1 token)", decode), (f"verify ({w} tokens)", verify),
                    ("drafter block (its layers, the lm_head once)", drafter_bytes + lm_head),
                    (f"DFlash K = {args.k} step", step)):
        print(f"| {name} | {b / 1e9:.2f} | {1e3 * b / bw:.2f} |")
    print(f"\nL = {w} at equal multiples of the floors: {w * decode / step:.2f}x target-only")


if __name__ == "__main__":
    main()
