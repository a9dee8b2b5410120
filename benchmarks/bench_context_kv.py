"""Context-K/V precompute: fused (one GEMM, grouped K-norm, one RoPE) vs the per-layer loop.

Builds DFlash drafters with random weights at real shapes (Laguna-XS-2.1-DFlash: 5 layers,
hidden 2048, 64 heads, 8 KV heads, head_dim 128; and the same shapes for the Qwen3 flavour),
checks the two paths agree, and times both in the same run for several context-row counts
(decode steps commit a+1 <= 16 rows; a prefill commits the whole prompt). Prints a table.

On CUDA with triton, a second table times what follows the GEMM (grouped K-RMSNorm + RoPE + the
cache writes of every layer): the torch reference ops vs the ONE-launch Triton kernel of
``kernels/context_kv.py`` (which the model's fused path uses there; ``fused us`` above includes it).

    python benchmarks/bench_context_kv.py --device cpu --dtype float32
    python benchmarks/bench_context_kv.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from laguna_dflash.config import resolve_dtype
from laguna_dflash.kernels import context_kv as ckv
from laguna_dflash.models.dflash import DFlashDraftModel, qwen3_draft_spec
from laguna_dflash.models.laguna_dflash import DFlashLaguna, laguna_draft_spec
from laguna_dflash.models.random_init import randomize_


def xs_draft_config(num_layers: int) -> dict:
    return {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": num_layers,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0, "max_position_embeddings": 262144, "sliding_window": 512,
        "layer_types": ["sliding_attention"] * num_layers, "gating": "per-head", "num_experts": 0,
        "vocab_size": 100352, "draft_vocab_size": 100352,
        "dflash_config": {"block_size": 16, "mask_token_id": 12, "num_target_layers": 40,
                          "target_layer_ids": [1, 13, 25, 33, 39], "causal": True},
    }


def build(flavour: str, num_layers: int, device: torch.device, dtype: torch.dtype):
    cfg = xs_draft_config(num_layers)
    if flavour == "laguna":
        model = DFlashLaguna(laguna_draft_spec(cfg, {}, None))
    else:
        model = DFlashDraftModel(qwen3_draft_spec(cfg, None))
    randomize_(model, seed=0)
    model = model.to(device=device, dtype=dtype).eval()
    model._build_context_kv_buffers()
    model.prepare_rope(8192, device)
    return model


def caches(model, num_slots: int, device, dtype):
    return [(torch.zeros(num_slots, model.num_kv_heads, model.head_dim, device=device, dtype=dtype),
             torch.zeros(num_slots, model.num_kv_heads, model.head_dim, device=device, dtype=dtype))
            for _ in model.layers]


def per_layer(model, context, positions, slots, kv):
    for (k, v), (kc, vc) in zip(model.reference_context_kv(context, positions), kv):
        kc.index_copy_(0, slots, k.to(kc.dtype))
        vc.index_copy_(0, slots, v.to(vc.dtype))


def timeit(fn, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--iters", type=int, default=0, help="0 = auto (more on GPU)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype)
    iters = args.iters or (200 if device.type == "cuda" else 20)
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"dtype={dtype}, drafter layers={args.layers}, torch {torch.__version__}")
    print(f"{'flavour':8} {'rows':>5} {'per-layer us':>13} {'fused us':>10} {'speedup':>8} {'max|diff|':>10}")
    for flavour in ("laguna", "qwen3"):
        model = build(flavour, args.layers, device, dtype)
        for n in (int(r) for r in args.rows.split(",")):
            context, positions, slots = context_rows(n, device, dtype)
            kv_ref, kv_fused = caches(model, 4096, device, dtype), caches(model, 4096, device, dtype)
            per_layer(model, context, positions, slots, kv_ref)
            model.precompute_and_store_context_kv(context, positions, slots, kv_fused)
            diff = max((a[slots] - b[slots]).abs().max().item()
                       for ref, fused in zip(kv_ref, kv_fused) for a, b in zip(ref, fused))
            args_ref = (model, context, positions, slots, kv_ref)
            t_ref = timeit(lambda a=args_ref: per_layer(*a), device, iters)
            args_fused = (context, positions, slots, kv_fused)
            t_fused = timeit(lambda m=model, a=args_fused: m.precompute_and_store_context_kv(*a),
                             device, iters)
            print(f"{flavour:8} {n:5d} {t_ref * 1e6:13.1f} {t_fused * 1e6:10.1f} "
                  f"{t_ref / t_fused:7.2f}x {diff:10.2e}")
    if device.type == "cuda" and ckv.is_available(device):
        bench_norm_rope_write(args, device, dtype, iters)


def context_rows(n: int, device: torch.device, dtype: torch.dtype):
    """``n`` random context rows ``[n, 2048]``, their positions and distinct cache slots (seeded by n)."""
    g = torch.Generator(device="cpu").manual_seed(n)
    context = torch.randn(n, 2048, generator=g).to(device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (n,), generator=g).to(device)
    slots = torch.randperm(4096, generator=g)[:n].to(device)
    return context, positions, slots


def bench_norm_rope_write(args, device: torch.device, dtype: torch.dtype, iters: int) -> None:
    """After the GEMM: torch K-norm + RoPE + per-layer writes vs the one Triton launch."""
    print(f"norm+rope+write after the GEMM ({args.layers} layers, kv heads 8, head_dim 128)")
    print(f"{'flavour':8} {'rows':>5} {'torch us':>9} {'triton us':>10} {'speedup':>8} {'max|diff|':>10}")
    for flavour in ("laguna", "qwen3"):
        model = build(flavour, args.layers, device, dtype)
        for n in (int(r) for r in args.rows.split(",")):
            context, positions, slots = context_rows(n, device, dtype)
            k, v = model._project_context_kv(context)
            common = (k, v, model.context_k_norm_weight, model.spec.rms_norm_eps, model.rotary.cos,
                      model.rotary.sin, positions, slots)
            kv_ref, kv_tri = caches(model, 4096, device, dtype), caches(model, 4096, device, dtype)
            ckv.context_kv_reference(*common, kv_ref)
            ckv.fused_context_kv_(*common, kv_tri)
            diff = max((a[slots].float() - b[slots].float()).abs().max().item()
                       for ref, tri in zip(kv_ref, kv_tri) for a, b in zip(ref, tri))
            t_ref = timeit(lambda a=common, c=kv_ref: ckv.context_kv_reference(*a, c), device, iters)
            t_tri = timeit(lambda a=common, c=kv_tri: ckv.fused_context_kv_(*a, c), device, iters)
            print(f"{flavour:8} {n:5d} {t_ref * 1e6:9.1f} {t_tri * 1e6:10.1f} {t_ref / t_tri:7.2f}x {diff:10.2e}")


if __name__ == "__main__":
    main()
