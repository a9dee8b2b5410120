"""Train the demo pair end to end in one call: target, regenerated data, drafter, held-out check.

    python -m laguna_dflash.train.pipeline OUT --device cuda --target-budget-s 200 \\
        --draft-budget-s 240 [--target-steps 600] [--num-sequences 8192] [--block-size 8]

Defaults follow the CPU step-cost study in docs/PERFORMANCE.md (12 layers, 4 experts of 128,
a one-layer drafter, block 8). Writes ``OUT/target`` (sharded under 15 MiB per file), ``OUT/draft`` and ``OUT/report.json``
(losses, held-out target loss, held-out mean acceptance length and per-position rates on
``assets/demo/heldout_prompts.json``), so the results of a remote GPU run fit its file limits.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from ..config import SamplingParams
from ..demo import heldout_prompts
from ..llm import LLM
from ..models.loader import load_model
from . import data
from .draft import DraftTrainConfig, train_draft
from .target import TargetTrainConfig, lm_loss, train_target


def heldout_target_loss(target_dir: Path, num_windows: int = 16, seq_len: int = 512) -> float:
    """Next-token loss of the target on windows of the held-out source (not seen in training)."""
    tokenizer = data.load_tokenizer(target_dir)
    stream = data.encode_corpus(data.read_texts(data.stdlib_files("heldout"), 3_000_000), tokenizer)
    stream = stream.astype(np.int64)
    model = load_model(target_dir)
    model.prepare_rope(seq_len + 1, "cpu")
    starts = np.random.default_rng(0).integers(0, len(stream) - seq_len - 1, size=num_windows)
    batch = torch.tensor(np.stack([stream[s : s + seq_len + 1] for s in starts]))
    with torch.no_grad():
        return float(lm_loss(model, batch))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target-layers", type=int, default=12)
    ap.add_argument("--num-experts", type=int, default=4)
    ap.add_argument("--moe-intermediate-size", type=int, default=128)
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--target-budget-s", type=float, default=200)
    ap.add_argument("--num-sequences", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-steps", type=int, default=20000)
    ap.add_argument("--draft-budget-s", type=float, default=240)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    tdir, ddir = args.out / "target", args.out / "draft"
    train_target(TargetTrainConfig(out_dir=str(tdir), device=args.device, batch_size=64,
                                   num_layers=args.target_layers, num_experts=args.num_experts,
                                   moe_intermediate_size=args.moe_intermediate_size,
                                   steps=args.target_steps, time_budget_s=args.target_budget_s,
                                   save_every=10**9))
    train_draft(DraftTrainConfig(target=str(tdir), out_dir=str(ddir), device=args.device,
                                 num_layers=args.draft_layers, block_size=args.block_size,
                                 gamma=7.0 if args.block_size >= 16 else 4.0,
                                 num_sequences=args.num_sequences, gen_batch_size=512, batch_size=32,
                                 steps=args.draft_steps, time_budget_s=args.draft_budget_s,
                                 save_every=10**9))
    llm = LLM(str(tdir), draft=str(ddir), device=args.device,
              dtype="bfloat16" if args.device.startswith("cuda") else "float32")
    llm.generate(heldout_prompts(), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    m = llm.get_metrics()
    report = {
        "heldout_target_loss": heldout_target_loss(tdir),
        "target_summary": json.loads((tdir / "work" / "train_summary.json").read_text()),
        "draft_summary": json.loads((ddir / "work" / "train_summary.json").read_text()),
        "heldout_mean_acceptance_length": m["mean_acceptance_length"],
        "heldout_per_position_acceptance_rate": [c / max(m["num_drafts"], 1)
                                                 for c in m["num_accepted_tokens_per_pos"]],
        "seconds": time.perf_counter() - t0,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("summary")}, indent=1))


if __name__ == "__main__":
    main()
