"""Laguna-XS-2.1-size decode on one GPU: ceilings, target-only step, DFlash step, the floor.

Dummy weights at the real shapes (reference/laguna.md sections 2, 4.1), bf16, batch 1, a 1k
context. Prints the device-to-device copy bandwidth and bf16 GEMM rate measured in the same run,
the eager engine's target-only decode step and DFlash step (K=15, random drafter, so acceptance
is ~0: this is the per-step cost), and the bandwidth floor of a decode step: bytes of the active
parameters plus the KV read, over the measured bandwidth.

    python benchmarks/bench_gpu_xs.py [--layers 40] [--context 1024] [--new-tokens 24]
    python benchmarks/bench_gpu_xs.py --device cpu --layers 2 --hidden 256 --context 64  # wiring
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from laguna_dflash import LLM, SamplingParams


def xs_target_config(num_layers: int) -> dict:
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    return {
        "architectures": ["LagunaForCausalLM"], "model_type": "laguna", "vocab_size": 100352,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": num_layers,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
        "num_attention_heads_per_layer": [48 if t == "full_attention" else 64 for t in types],
        "layer_types": types, "sliding_window": 512, "gating": "per-head",
        "mlp_layer_types": ["dense"] + ["sparse"] * (num_layers - 1), "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "moe_routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                               "original_max_position_embeddings": 8192, "beta_fast": 64.0,
                               "beta_slow": 1.0, "partial_rotary_factor": 0.5,
                               "attention_factor": 1.3465735902799727},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
        "eos_token_id": [2, 24],
    }


def xs_draft_config(num_target_layers: int) -> dict:
    taps = [t for t in (1, 13, 25, 33, 39) if t < num_target_layers] or [0]
    return {
        "architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 5, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "max_position_embeddings": 262144, "sliding_window": 512,
        "layer_types": ["sliding_attention"] * 5, "gating": "per-head", "num_experts": 0,
        "vocab_size": 100352, "draft_vocab_size": 100352,
        "dflash_config": {"block_size": 16, "mask_token_id": 12, "num_target_layers": num_target_layers,
                          "target_layer_ids": taps, "causal": True},
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - t0)  # read + write


def gemm_tflops(device: str, n: int = 8192) -> float:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def active_bytes(model, context: int) -> int:
    """Bytes a batch-1 decode step must read: all non-expert weights except the embedding table,
    top_k of E experts per MoE layer, and the visible KV (full layers: context; SWA: window)."""
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name.startswith("embed_tokens"):
            continue
        if "experts_" in name:
            moe = model.spec.moe
            n = n * moe.top_k // moe.num_experts
        total += n
    s = model.spec
    per_token = 2 * s.num_kv_heads * s.head_dim * 2
    for layer in s.layers:
        total += per_token * (min(context, layer.sliding_window) if layer.sliding_window else context)
    return total


def step_time(llm: LLM, prompt: list[int], new_tokens: int, batch: int = 1) -> float:
    """Mean seconds per decode (or DFlash) step of ``batch`` copies of ``prompt``."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt[:64]] * batch, sampling_params=params)  # warm-up
    before = llm.get_metrics()
    llm.generate(prompt_token_ids=[prompt] * batch, sampling_params=params)
    sync(llm.config.device)
    after = llm.get_metrics()
    steps = after["num_decode_steps"] - before["num_decode_steps"]
    return (after["decode_s"] - before["decode_s"]) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--batches", default="1,4,16,64", help="batch sizes to time")
    ap.add_argument("--ks", default="1,3,7,15", help="draft counts K for the batch-1 DFlash step")
    ap.add_argument("--simulated", default="1,2,4,8", help="simulated acceptance lengths to time")
    ap.add_argument("--sim-k", type=int, default=7, help="K used for the simulated-acceptance runs")
    ap.add_argument("--device", default="cuda", help="cpu runs a wiring check at small sizes")
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU wiring check")
    args = ap.parse_args()
    cpu = not args.device.startswith("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth(args.device, 64 << 20 if cpu else 4 << 30)
    tflops = gemm_tflops(args.device, 512 if cpu else 8192)
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = Path(tmp) / "target", Path(tmp) / "draft"
        tdir.mkdir()
        ddir.mkdir()
        tcfg, dcfg = xs_target_config(args.layers), xs_draft_config(args.layers)
        if args.hidden != 2048:  # CPU wiring check: shrink every width, keep the structure
            f = args.hidden / 2048
            for c in (tcfg, dcfg):
                c.update(hidden_size=args.hidden, intermediate_size=int(8192 * f), vocab_size=4096)
            dcfg["draft_vocab_size"] = 4096
            tcfg.update(num_experts=16, moe_intermediate_size=int(512 * f),
                        shared_expert_intermediate_size=int(512 * f))
        (tdir / "config.json").write_text(json.dumps(tcfg))
        (ddir / "config.json").write_text(json.dumps(dcfg))
        max_batch = max(batches)
        common = dict(dtype="float32" if cpu else "bfloat16", device=args.device, load_format="dummy",
                      max_model_len=args.context + 256, max_num_seqs=max_batch,
                      num_kv_blocks=(args.context + 320) // 16 * (max_batch + 1))
        t0 = time.perf_counter()
        spec = LLM(str(tdir), draft=str(ddir), **common)
        load_s = time.perf_counter() - t0
        prompt = torch.randint(100, tcfg["vocab_size"] - 1, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        floor = active_bytes(spec.engine.target, args.context) / bw
        engine = spec.engine
        max_k = engine.num_speculative_tokens
        # DFlash step (draft K tokens + verify K+1) at batch 1, random drafter; acceptance is
        # forced to 1 (no drafts kept) so every step costs the same
        engine.simulated_acceptance, engine._sim_carry = 1.0, 0.0
        k_steps = {}
        for k in (int(x) for x in args.ks.split(",")):
            engine.num_speculative_tokens = min(k, max_k)
            k_steps[k] = step_time(spec, prompt, args.new_tokens)
        engine.num_speculative_tokens = min(args.sim_k, max_k)
        simulated = {}  # (batch, length) -> seconds per token per request
        for b in batches:
            for length in (float(x) for x in args.simulated.split(",")):
                engine.simulated_acceptance, engine._sim_carry = length, 0.0
                simulated[b, length] = step_time(spec, prompt, args.new_tokens, b) / length
        engine.simulated_acceptance = None
        # target-only on the same weights (two 67 GB copies would not fit): detach the proposer
        proposer, engine.proposer, engine.tap_layer_ids = engine.proposer, None, ()
        base = {b: step_time(spec, prompt, args.new_tokens, b) for b in batches}
        engine.proposer = proposer
    name = torch.cuda.get_device_name() if not cpu else "cpu"
    print(f"device {name}, torch {torch.__version__}, layers {args.layers}, "
          f"context {args.context}, dummy load {load_s:.1f}s")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 GEMM {tflops:.0f} TFLOP/s\n")
    print("| batch-1 step | ms | x floor |\n|---|---:|---:|")
    print(f"| bandwidth floor (decode) | {floor * 1e3:.2f} | 1.00 |")
    print(f"| target-only decode | {base[1] * 1e3:.2f} | {base[1] / floor:.2f} |" if 1 in base else "")
    for k, t in k_steps.items():
        print(f"| DFlash K={k} (draft + verify {k + 1}) | {t * 1e3:.2f} | {t / floor:.2f} |")
    lengths = sorted({length for _, length in simulated})
    print("\n| batch | target-only tok/s | " + " | ".join(f"L={x:g} tok/s (x)" for x in lengths) + " |")
    print("|---:|---:|" + "---:|" * len(lengths))
    for b in batches:
        cells = [f"{b / simulated[b, x]:.1f} ({base[b] / simulated[b, x]:.2f}x)" for x in lengths]
        print(f"| {b} | {b / base[b]:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
