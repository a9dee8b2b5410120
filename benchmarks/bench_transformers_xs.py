"""transformers' LagunaForCausalLM at Laguna-XS-2.1 shapes: batch-1 decode step time (baseline).

Same config as ``bench_gpu_xs.py`` (random weights, bf16, a 1k-token context), run through
transformers' own model with its KV cache and the ``grouped_mm`` experts implementation; prints
ms per decode step. Run it in its own process after ``bench_gpu_xs.py`` (both models at once do
not fit one H200).

    python benchmarks/bench_transformers_xs.py [--layers 40] [--context 1024] [--new-tokens 16]
    python benchmarks/bench_transformers_xs.py --device cpu --layers 2 --hidden 256 --context 64
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_gpu_xs import sync, xs_target_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU wiring check")
    ap.add_argument("--experts", default="grouped_mm", help="transformers experts implementation")
    args = ap.parse_args()
    import transformers
    from transformers import LagunaConfig, LagunaForCausalLM

    cfg = xs_target_config(args.layers)
    if args.hidden != 2048:
        f = args.hidden / 2048
        cfg.update(hidden_size=args.hidden, intermediate_size=int(8192 * f), vocab_size=4096,
                   num_experts=16, moe_intermediate_size=int(512 * f),
                   shared_expert_intermediate_size=int(512 * f))
    for key in ("architectures", "model_type"):
        cfg.pop(key)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.set_default_dtype(dtype)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = LagunaForCausalLM(LagunaConfig(**cfg)).eval()
    torch.set_default_dtype(torch.float32)
    try:
        model.set_experts_implementation(args.experts)
    except Exception as e:  # noqa: BLE001 - report and keep the default implementation
        print(f"experts implementation {args.experts!r} not set: {e}")
    load_s = time.perf_counter() - t0
    prompt = torch.randint(100, cfg["vocab_size"] - 1, (1, args.context), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(0))

    def decode(n: int) -> float:
        with torch.inference_mode():
            out = model(input_ids=prompt, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(n):
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync(args.device)
        return (time.perf_counter() - t0) / n

    decode(2)  # warm-up
    step = decode(args.new_tokens)
    impl = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else "?"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, experts {impl}, "
          f"layers {args.layers}, context {args.context}, init {load_s:.1f}s")
    print(f"| transformers LagunaForCausalLM batch-1 decode step | {step * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
