"""Tensor parallelism at Laguna-XS-2.1 widths on ONE GPU: two gloo ranks share it (eager), so the
CUDA kernels run at the sharded shapes (24 / 32 query heads, 4 KV heads, expert width 256, half
the vocabulary) without a second GPU. Checks them against one process on the same checkpoint:

* prompt logits: the largest absolute difference, relative to the logits' largest magnitude;
* greedy tokens, target-only and DFlash (K = 3), per dtype; DFlash = target-only on the ranks;
* DFlash with the drafter sharded (the default) and replicated (``draft_tensor_parallel_size``
  1): each spec step's draft tokens against one process's, and the acceptance length.

``--enable-expert-parallel``: the ranks split the routed experts by expert instead (128 whole
experts each, the MoE kernels skipping the other rank's pairs).

The checkpoint is written here (random weights, ``--layers`` layers of XS-2.1 widths, float32
safetensors, the real on-disk names) so both runs load the same values::

    python benchmarks/check_tp_xs.py --layers 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu_xs import write_xs_configs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tp_worker  # noqa: E402

from laguna_dflash.models.laguna import LagunaForCausalLM  # noqa: E402
from laguna_dflash.models.laguna_dflash import DFlashLaguna  # noqa: E402
from laguna_dflash.models.random_init import randomize_  # noqa: E402
from laguna_dflash.models.writer import save_checkpoint  # noqa: E402


def write_pair(root: Path, num_layers: int, hidden: int = 2048) -> tuple[Path, Path]:
    """The pair's random weights in the real on-disk format (``hidden`` other than 2048: every
    width shrunk with it, as ``bench_gpu_xs.write_xs_configs`` does: a CPU wiring check)."""
    (root / "configs").mkdir()
    _, ddir, tcfg = write_xs_configs(root / "configs", num_layers, hidden)
    dcfg = json.loads((ddir / "config.json").read_text())
    target = LagunaForCausalLM.from_config(tcfg)
    randomize_(target, 0)
    tdir = save_checkpoint(target, root / "target", tcfg)
    draft = DFlashLaguna.from_config(dcfg, {}, target)
    randomize_(draft, 1)
    return tdir, save_checkpoint(draft, root / "draft", dcfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a wiring check (with --hidden 256 or less)")
    ap.add_argument("--hidden", type=int, default=2048,
                    help="other than 2048: every width shrunk with it (a CPU wiring check)")
    ap.add_argument("--only-dflash", action="store_true",
                    help="only the two DFlash jobs a dtype (no prompt logits, no target-only): "
                         "about half the time (each job is an engine on both ranks and on one)")
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = 100000 if args.hidden == 2048 else 4000  # write_xs_configs: 4096 when shrunk
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 97)]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tdir, ddir = write_pair(Path(tmp), args.layers, args.hidden)
        print(f"# wrote the {args.layers}-layer XS-2.1-width pair in {time.perf_counter() - t0:.1f} s",
              flush=True)
        jobs, names = [], []
        for dtype in args.dtypes.split(","):
            opts = {"device": args.device, "enforce_eager": True, "dtype": dtype,
                    "enable_expert_parallel": args.enable_expert_parallel}
            gen = {"kind": "generate", "model": str(tdir), "prompts": prompts,
                   "max_tokens": args.new_tokens, "options": opts}
            if not args.only_dflash:
                jobs += [{"kind": "prompt_logits", "model": str(tdir), "prompt": prompts[1],
                          "options": opts}, gen]
                names += [(dtype, "logits"), (dtype, "target-only")]
            traced = {**opts, "trace": True}
            jobs += [{**gen, "draft": str(ddir), "options": traced},
                     {**gen, "draft": str(ddir), "options": {**traced, "draft_tensor_parallel_size": 1}}]
            names += [(dtype, "dflash K=3"), (dtype, "dflash K=3, drafter replicated")]
        for job in jobs:
            job["skip_warmup_prefills"] = True  # every engine here prefills these 2 prompts only
            if job.get("draft"):
                job["options"]["num_speculative_tokens"] = 3
        t0 = time.perf_counter()
        sharded = tp_worker.run_ranks(jobs, world_size=2, backend="gloo")
        print(f"# two gloo ranks on one {args.device} device: {time.perf_counter() - t0:.1f} s", flush=True)
        single = [tp_worker.to_cpu(tp_worker.run_job(job, tensor_parallel_size=1)) for job in jobs]
    print(f"# experts split by {'expert' if args.enable_expert_parallel else 'width'}")
    print("| dtype | what | ranks equal | tp=2 vs tp=1 | DFlash = target-only (tp=2) | steps whose drafts "
          "equal tp=1's | acceptance length tp=2 / tp=1 |")
    print("|---|---|---|---|---|---|---|")
    for i, (dtype, what) in enumerate(names):
        a, b, one = sharded[0][i], sharded[1][i], single[i]
        if what == "logits":
            same = torch.equal(a, b)
            rel = ((a - one).abs().max() / one.abs().max()).item()
            top = (a.argmax(-1) == one.argmax(-1)).float().mean().item()
            print(f"| {dtype} | prompt logits | {same} | max |diff| / max |logit| = {rel:.2e}, "
                  f"argmax equal at {top:.0%} of positions | | | |")
            continue
        equal = sum(x == y for x, y in zip(a[0], one[0]))
        lossless = drafts = acceptance = ""
        if what.startswith("dflash"):
            if (dtype, "target-only") in names:
                lossless = str(a[0] == sharded[0][names.index((dtype, "target-only"))][0])
            same = total = 0
            for trace, want_trace in zip(a[2], one[2]):  # a prompt's steps, by anchor position
                want = {s["anchor_position"]: s["draft_tokens"] for s in want_trace}
                same += sum(want.get(s["anchor_position"]) == s["draft_tokens"] for s in trace)
                total += len(trace)
            drafts = f"{same} of {total}"
            acceptance = f"{sum(a[1]) / len(a[1]):.2f} / {sum(one[1]) / len(one[1]):.2f}"
        print(f"| {dtype} | greedy {what} | {a == b} | {equal} of {len(one[0])} sequences equal | "
              f"{lossless} | {drafts} | {acceptance} |")


if __name__ == "__main__":
    main()
