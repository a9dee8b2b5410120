"""Train the demo pair end to end on one GPU: target, regenerated data, drafter(s), held-out check.

    python -m laguna_dflash.train.pipeline OUT --device cuda --target-budget-s 170 \\
        --regen-budget-s 90 --draft-budget-s 190 [--stage all|target|draft] [--draft-layers 1]

``--stage target`` trains ``OUT/target`` (sharded under 15 MiB per file) and regenerates the
drafter's data once into ``OUT/regenerated.npy``; ``--stage draft`` trains ``OUT/draft-L<n>``
from it (several drafter variants can train side by side on one GPU, one process each) and writes
``OUT/report-L<n>.json``: held-out target loss, held-out mean acceptance length and
per-position acceptance rates on ``assets/demo/heldout_prompts.json``. ``--stage all`` does both.
A corpus prepared beforehand (``OUT/target/tokenizer.json`` and
``OUT/target/work/train_tokens.npy``, see ``train.target.build_corpus``) is reused as is.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..config import SamplingParams
from ..demo import heldout_prompts
from ..llm import LLM
from ..models.loader import load_model
from . import data
from .draft import DraftTrainConfig, regenerate, train_draft
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


def heldout_acceptance(target_dir: Path, draft_dir: Path, device: str, max_tokens: int) -> dict:
    """Greedy speculative decoding (K = block_size - 1) of the held-out prompts."""
    llm = LLM(str(target_dir), draft=str(draft_dir), device=device,
              dtype="bfloat16" if device.startswith("cuda") else "float32")
    llm.generate(heldout_prompts(), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    m = llm.get_metrics()
    return {"max_tokens": max_tokens, "mean_acceptance_length": m["mean_acceptance_length"],
            "per_position_acceptance_rate": [c / max(m["num_drafts"], 1)
                                             for c in m["num_accepted_tokens_per_pos"]]}


def summary_without_curve(path: Path, every: int = 100) -> dict:
    """A training summary with its loss curve thinned to one mean per ``every`` steps."""
    summary = json.loads(path.read_text())
    losses = summary.pop("losses", [])
    summary["loss_curve"] = [float(np.mean(losses[i : i + every])) for i in range(0, len(losses), every)]
    return summary


def draft_train_config(args: argparse.Namespace, out: Path, draft_dir: Path) -> DraftTrainConfig:
    return DraftTrainConfig(target=str(out / "target"), out_dir=str(draft_dir), device=args.device,
                            num_layers=args.draft_layers, block_size=args.block_size,
                            gamma=7.0 if args.block_size >= 16 else 4.0,
                            num_sequences=args.num_sequences, gen_batch_size=512,
                            batch_size=args.draft_batch_size, steps=args.draft_steps,
                            time_budget_s=args.draft_budget_s, regen_budget_s=args.regen_budget_s,
                            init_from=args.init_from, lr=args.draft_lr, warmup=args.draft_warmup,
                            save_every=10**9)


def run_target_stage(args: argparse.Namespace) -> None:
    out = args.out
    train_target(TargetTrainConfig(out_dir=str(out / "target"), device=args.device,
                                   batch_size=args.target_batch_size, num_layers=args.target_layers,
                                   num_experts=args.num_experts,
                                   moe_intermediate_size=args.moe_intermediate_size,
                                   steps=args.target_steps, time_budget_s=args.target_budget_s,
                                   save_every=10**9))
    regenerate(draft_train_config(args, out, out / "draft"), out)  # caches OUT/regenerated.npy


def run_draft_stage(args: argparse.Namespace) -> None:
    out, t0 = args.out, time.perf_counter()
    name = f"draft-L{args.draft_layers}"
    work = out / name / "work"
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "regenerated.npy", work / "regenerated.npy")
    ddir = train_draft(draft_train_config(args, out, out / name))
    report = {
        "heldout_target_loss": heldout_target_loss(out / "target"),
        "heldout": [heldout_acceptance(out / "target", ddir, args.device, n) for n in (64, 128)],
        "target_summary": summary_without_curve(out / "target" / "work" / "train_summary.json"),
        "draft_summary": summary_without_curve(ddir / "work" / "train_summary.json"),
        "seconds": time.perf_counter() - t0,
    }
    (out / f"report-L{args.draft_layers}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("heldout_target_loss", "heldout")}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--stage", choices=("all", "target", "draft"), default="all")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target-layers", type=int, default=12)
    ap.add_argument("--num-experts", type=int, default=4)
    ap.add_argument("--moe-intermediate-size", type=int, default=128)
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--target-batch-size", type=int, default=64)
    ap.add_argument("--target-budget-s", type=float, default=170)
    ap.add_argument("--num-sequences", type=int, default=8192)
    ap.add_argument("--regen-budget-s", type=float, default=None)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-batch-size", type=int, default=32)
    ap.add_argument("--draft-steps", type=int, default=20000)
    ap.add_argument("--draft-budget-s", type=float, default=190)
    ap.add_argument("--draft-lr", type=float, default=1e-3)
    ap.add_argument("--draft-warmup", type=int, default=100)
    ap.add_argument("--init-from", default=None, help="continue from this drafter checkpoint")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.stage in ("all", "target"):
        run_target_stage(args)
    if args.stage in ("all", "draft"):
        run_draft_stage(args)


if __name__ == "__main__":
    main()
