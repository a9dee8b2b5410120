"""The hybrid KV layout against the unified one at Laguna-XS-2.1 size: what the default KV
budget holds, and the step times (the layout adds one metadata build a sliding group a forward).

    python benchmarks/bench_hybrid_kv.py                 # H200: XS-2.1 pair, dummy bf16 weights
    python benchmarks/bench_hybrid_kv.py --device cpu --hidden 256 --layers 8   # wiring check

For each layout (unified; hybrid with the drafter's own full-context cache; hybrid with the
drafter's sliding layers in a group of the pool, the default), one engine in turn (the drafter
loaded, KV sized by the default memory share):
the KV cache's GiB and blocks, how many tokens of context it holds (every block given to the
full layers' tables, less one window of each sliding group per sequence), how many sequences of
``--long-context`` tokens fit at once, then the batch-1 target-only decode step, batch-16
decode tokens/s and DFlash at simulated acceptance 4 (K = 3) at batch 1, each timed after a
warm-up run; and whether the greedy tokens equal across the layouts.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch
from bench_gpu_xs import decode_tokens_per_s, step_time, write_xs_configs

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine import engine as engine_module
from laguna_dflash.engine.kv_cache import KVCache


def capacity(llm: LLM, long_context: int) -> dict:
    """The KV cache's size and what it holds (see the module docstring)."""
    engine = llm.engine
    kv, bs, layout = engine.runner.kv_cache, engine.allocator.block_size, engine.kv_layout
    num_blocks = engine.allocator.num_blocks
    gib = KVCache.num_bytes(kv, *([engine.proposer.kv_cache] if engine.proposer else [])) / 2**30
    # a window (and a step's blocks) of each sliding group, per sequence
    swa_blocks = 0 if layout is None else layout.num_swa_groups * (-(-(layout.sliding_window + 16) // bs) + 1)
    return {"kv_gib": gib, "blocks": num_blocks, "tokens": (num_blocks - swa_blocks) * bs,
            "long_seqs": num_blocks // (-(-long_context // bs) + swa_blocks)}


# (name, disable_hybrid_kv_cache_manager, the drafter in a sliding group of the pool)
LAYOUTS = (("unified", True, False), ("hybrid, drafter's own cache", False, False), ("hybrid", False, True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=2048, help="other than 2048: a CPU wiring check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of the timed runs")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--long-context", type=int, default=32768)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    prompt = [(7 * i) % 1000 + 3 for i in range(args.context)]
    rows, tokens, base_rows = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir, _ = write_xs_configs(Path(tmp), args.layers, args.hidden)
        for name, disable, draft_in_pool in LAYOUTS:
            common = dict(dtype="bfloat16" if cuda else "float32", device=args.device,
                          load_format="dummy", max_model_len=args.long_context, max_num_seqs=args.max_num_seqs,
                          cuda_graph_capture="lazy", disable_hybrid_kv_cache_manager=disable)
            if not cuda:
                common["num_kv_blocks"] = 4096
            engine_module.drafter_in_sliding_group = draft_in_pool
            spec = LLM(str(tdir), draft=str(ddir), num_speculative_tokens=3,
                       simulate_acceptance_length=4.0, **common)
            engine_module.drafter_in_sliding_group = True
            assert bool(spec.engine.kv_layout and spec.engine.kv_layout.draft_group) == draft_in_pool
            row = {"layout": name, "disable": disable, **capacity(spec, args.long_context)}
            decode_tokens_per_s(spec, prompt, args.new_tokens, 1)  # warm
            row["dflash_tok_s"] = decode_tokens_per_s(spec, prompt, args.new_tokens, 1)
            del spec
            _free(cuda)
            rows.append(row)
            if disable in base_rows:  # the target alone: the same layout as the row before
                continue
            base = LLM(str(tdir), **common)
            b = base_rows[disable] = {"decode_ms": step_time(base, prompt, args.new_tokens) * 1e3,
                                      "tok_s_1": decode_tokens_per_s(base, prompt, args.new_tokens, 1)}
            decode_tokens_per_s(base, prompt, args.new_tokens, 16)  # warm: graphs of this size
            b["tok_s_16"] = decode_tokens_per_s(base, prompt, args.new_tokens, 16)
            params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
            tokens.append(base.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids)
            del base
            _free(cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    per_token = KVCache.bytes_per_block(1, 1, 8, 128, torch.bfloat16)
    print(f"# {name}, XS-2.1 pair ({args.layers} layers), dummy weights, default KV share, "
          f"max_model_len {args.long_context}; a layer's K/V is {per_token} B a token; target-only "
          "columns: the target's own layout (no drafter)")
    print(f"| layout | KV GiB | blocks | tokens held | {args.long_context}-token sequences at once | "
          "batch-1 decode ms | batch-16 decode tok/s | DFlash L=4 batch 1, x target-only |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base_rows[r["disable"]]
        print(f"| {r['layout']} | {r['kv_gib']:.1f} | {r['blocks']} | {r['tokens']} | {r['long_seqs']} | "
              f"{b['decode_ms']:.3f} | {b['tok_s_16']:.1f} | {r['dflash_tok_s'] / b['tok_s_1']:.2f} |")
    print(f"greedy tokens equal across the layouts: {tokens[0] == tokens[1]}")


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
