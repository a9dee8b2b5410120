"""Tensor parallelism at Laguna-XS-2.1 / S-2.1 size: decode step and DFlash tokens/s per rank count.

Run once per rank count, the same way users launch the engine (dummy weights, bf16, context
``--context`` tokens); rank 0 prints one table row per batch size, and ``--json FILE`` appends
the rows so several launches make one table::

    python benchmarks/bench_tp.py --json rows.jsonl                             # 1 GPU
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --tp 2 --json rows.jsonl  # 2 GPUs

Per batch size: the target-only decode step (ms) and tokens/s, and DFlash tokens/s at a
simulated acceptance length (``--acceptance``, K = ``--k``; every draft accepted up to it:
system speed apart from draft quality, as SGLang's SGLANG_SIMULATE_ACC_LEN), once per
``--draft-tp`` setting (``auto,1``: the drafter sharded as the target, then replicated). The header gives
rank 0's batch-1 bandwidth floor: the bytes its shard reads a decode step (active weights and
visible KV, ``bench_gpu_xs.active_bytes``) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu_xs import (
    active_bytes,
    copy_bandwidth,
    decode_tokens_per_s,
    step_time,
    write_xs_configs,
    xs_draft_config,
    xs_target_config,
)

from laguna_dflash import LLM


def s21_target_config(num_layers: int = 48) -> dict:
    """Laguna-S-2.1's ``config.json`` (reference/laguna.md section 2: 117.6 B parameters, 219
    GiB in bf16, more than one H200 holds), on XS-2.1's schema."""
    cfg = xs_target_config(num_layers)
    types = cfg["layer_types"]
    cfg.update(hidden_size=3072, intermediate_size=12288, num_experts_per_tok=10,
               moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
               num_attention_heads_per_layer=[48 if t == "full_attention" else 72 for t in types],
               max_position_embeddings=1048576)
    cfg["rope_parameters"]["full_attention"].update(
        factor=128.0, beta_fast=32.0, attention_factor=1.4852030263919618)
    return cfg


def s21_draft_config(num_target_layers: int = 48) -> dict:
    """Laguna-S-2.1-DFlash: 6 sliding layers of 72 heads, taps [1, 10, 19, 29, 38, 47]."""
    cfg = xs_draft_config(num_target_layers)
    cfg.update(hidden_size=3072, intermediate_size=12288, num_hidden_layers=6,
               num_attention_heads=72, layer_types=["sliding_attention"] * 6,
               max_position_embeddings=1048576)
    cfg["dflash_config"]["target_layer_ids"] = [
        t for t in (1, 10, 19, 29, 38, 47) if t < num_target_layers] or [0]
    return cfg


def write_configs(directory: Path, model: str, num_layers: int, hidden: int) -> tuple[Path, Path]:
    """The XS-2.1 (``write_xs_configs``) or S-2.1 pair's ``config.json`` files -> (target, drafter)."""
    if model == "xs":
        tdir, ddir, _ = write_xs_configs(directory, num_layers, hidden)
        return tdir, ddir
    tdir, ddir = directory / "target", directory / "draft"
    tdir.mkdir()
    ddir.mkdir()
    (tdir / "config.json").write_text(json.dumps(s21_target_config(num_layers)))
    (ddir / "config.json").write_text(json.dumps(s21_draft_config(num_layers)))
    return tdir, ddir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (torchrun ranks)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--acceptance", type=float, default=4.0)
    ap.add_argument("--model", choices=("xs", "s21"), default="xs",
                    help="Laguna-XS-2.1 (fits one H200) or Laguna-S-2.1 (needs two or more)")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's (40 / 48)")
    ap.add_argument("--hidden", type=int, default=2048, help="XS only, other than 2048: CPU wiring check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="routed experts split by expert over the ranks (else by width)")
    ap.add_argument("--draft-tp", default="auto",
                    help="comma-separated drafter tensor-parallel settings, one DFlash engine each "
                         "(auto: sharded where its widths divide the ranks; 1: replicated; N: "
                         "sharded), e.g. auto,1 to time the sharded drafter against the replicated")
    ap.add_argument("--json", help="append the rows (JSON Lines) to this file")
    args = ap.parse_args()
    draft_tps = [None if v == "auto" else int(v) for v in args.draft_tp.split(",")]
    args.layers = args.layers or (40 if args.model == "xs" else 48)
    batches = [int(b) for b in args.batches.split(",")]
    rank = int(os.environ.get("RANK", "0"))
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    max_len = args.context + args.new_tokens + 2 * args.k + 16
    common = dict(dtype=dtype, device=args.device, load_format="dummy", max_model_len=max_len,
                  max_num_seqs=max(batches), tensor_parallel_size=args.tp,
                  enable_expert_parallel=args.enable_expert_parallel,
                  num_kv_blocks=(max_len + 16) // 16 * (max(batches) + 1),
                  cuda_graph_capture="lazy")
    prompt = [(7 * i) % 1000 + 3 for i in range(args.context)]
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = write_configs(Path(tmp), args.model, args.layers, args.hidden)
        t0 = time.perf_counter()
        base = LLM(str(tdir), **common)
        load_s = time.perf_counter() - t0
        floor_s = active_bytes(base.engine.target, args.context) / copy_bandwidth(args.device, 1 << 30)
        rows = []
        for b in batches:
            step = step_time(base, prompt, args.new_tokens, b)
            rows.append({"tp": args.tp, "ep": args.enable_expert_parallel, "batch": b, "step_ms": step * 1e3,
                         "target_tok_s": decode_tokens_per_s(base, prompt, args.new_tokens, b)})
        del base
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        for i, draft_tp in enumerate(draft_tps):
            spec = LLM(str(tdir), draft=str(ddir), num_speculative_tokens=args.k,
                       simulate_acceptance_length=args.acceptance, draft_tensor_parallel_size=draft_tp,
                       **common)
            sharded = spec.engine.drafter.tp.world_size  # the ranks the drafter is split over
            for row in rows:
                b = row["batch"]
                decode_tokens_per_s(spec, prompt, args.new_tokens, b)  # warm: graphs of this size
                tok_s = decode_tokens_per_s(spec, prompt, args.new_tokens, b)
                suffix = "" if i == 0 else f"_{i}"  # the first setting keeps the plain keys
                row.update({f"draft_tp{suffix}": sharded, f"dflash_tok_s{suffix}": tok_s,
                            f"dflash_x{suffix}": tok_s / row["target_tok_s"]})
            del spec
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if rank != 0:
        return
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# {name}, tp={args.tp}{' (experts split by expert)' if args.enable_expert_parallel else ''}, {dtype} {args.model} size ({args.layers} layers), context "
          f"{args.context}, {args.new_tokens} new tokens, DFlash K={args.k} at simulated "
          f"acceptance {args.acceptance}; load + warm-up {load_s:.1f} s; rank 0's batch-1 "
          f"bandwidth floor {floor_s * 1e3:.3f} ms")
    names = [f"drafter split over {rows[0]['draft_tp' + ('' if i == 0 else f'_{i}')]}"
             for i in range(len(draft_tps))]
    print("| tp | batch | target-only step ms | x floor | target-only tok/s | "
          + " | ".join(f"DFlash tok/s ({n}) | x" for n in names) + " |")
    print("|---:|---:|---:|---:|---:|" + "---:|---:|" * len(draft_tps))
    for r in rows:
        # the floor is batch 1's: more rows read more experts and KV
        r["floor_ms"] = floor_s * 1e3
        x_floor = f"{r['step_ms'] / r['floor_ms']:.2f}" if r["batch"] == 1 else "-"
        cells = " | ".join(f"{r['dflash_tok_s' + s]:.1f} | {r['dflash_x' + s]:.2f}"
                           for s in ("" if i == 0 else f"_{i}" for i in range(len(draft_tps))))
        print(f"| {r['tp']} | {r['batch']} | {r['step_ms']:.2f} | {x_floor} | "
              f"{r['target_tok_s']:.1f} | {cells} |")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
