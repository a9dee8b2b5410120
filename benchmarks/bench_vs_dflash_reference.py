"""Our engine against the PyPI ``dflash`` reference (``dflash_generate``), same weights, batch 1.

A random Qwen3 target and a z-lab format (Qwen3-flavour) DFlash drafter are written with the test
fixtures (``tests/dflash_fixtures.py``); both implementations load the same checkpoints. Greedy
generation of ``--new-tokens`` tokens for a few random-id prompts, timed end to end (prefill
included) after a warm-up, for:

* ``dflash_generate``: the reference loop, transformers backend, target and drafter loaded the way
  ``dflash benchmark transformers`` loads them (sdpa, ``--dtype``);
* ``laguna-dflash spec``: ``LLM(target, draft=drafter)``;
* ``laguna-dflash target-only``: ``LLM(target)``;
* ``transformers generate``: ``target.generate(do_sample=False)`` on the reference target.

Outputs are compared with our target-only tokens: at float32 our spec, our target-only and the
reference must agree exactly (the script fails otherwise); at bf16 the number of matching tokens
(common prefix) is reported instead. Acceptance length = generated tokens per verify step (the
prefill token not counted), for both speculative implementations.

The drafter is distilled by the fixture on CPU (``--distill-steps``); at the GPU sizes that is too
slow, so by default the drafter is random there (acceptance ~1): the spec rows then measure the
cost of a DFlash step, which is still a like-for-like comparison of the two loops.

On the lent H200 (2026-11-29) a decode step of this 12-layer model took ~45 ms in every
implementation (launch/host bound, not GPU bound), so the defaults are 2 prompts x 128 tokens.

    python benchmarks/bench_vs_dflash_reference.py                     # H200, bf16
    OMP_NUM_THREADS=1 python benchmarks/bench_vs_dflash_reference.py --small --device cpu \
        --dtype float32                                                # CPU wiring check
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from laguna_dflash import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import dflash_fixtures as df  # noqa: E402

# (target Qwen3Config overrides, drafter layers, drafter Qwen3Config overrides, prompt lengths,
#  default distill steps)
SIZES = {
    "full": (
        dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=8, head_dim=64,
             max_position_embeddings=4096),
        2,
        dict(num_attention_heads=16, num_key_value_heads=8, head_dim=64, intermediate_size=3072),
        (64, 512),
        0,
    ),
    "small": (
        dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=1024),
        2,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        (8, 48),
        200,
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], object]) -> tuple[object, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_pair(root: Path, size: str, block_size: int, distill_steps: int) -> tuple[Path, Path]:
    target_kw, draft_layers, draft_kw, _, _ = SIZES[size]
    layers = target_kw["num_hidden_layers"]
    taps = sorted({1, layers // 2, layers - 2})  # never the last layer (post-norm in transformers)
    target = df.make_tiny_qwen3_target(root / "target", seed=3, **target_kw)
    draft = df.make_zlab_drafter(root / "draft", target, seed=3, num_layers=draft_layers,
                                 block_size=block_size, target_layer_ids=taps,
                                 distill_steps=distill_steps, **draft_kw)
    return target, draft


def load_reference(target_dir: Path, draft_dir: Path, device: str, dtype: torch.dtype):
    """Target and drafter as ``dflash benchmark transformers`` loads them (sdpa, one dtype)."""
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(
        str(target_dir), attn_implementation="sdpa", dtype=dtype).to(device).eval()
    draft = DFlashDraftModel.from_pretrained(
        str(draft_dir), attn_implementation="sdpa", dtype=dtype).to(device).eval()
    return target, draft


def run_dflash_reference(target, draft, prompt: list[int], n: int, block_size: int):
    """``dflash_generate`` greedy; returns (new tokens, per-verify-step acceptance lengths)."""
    from dflash.model import dflash_generate

    ids = torch.tensor([prompt], device=target.device)
    with df._cpu_safe_dflash_timing():  # return_stats syncs CUDA unconditionally (CPU-safe here)
        stats = dflash_generate(draft, target, ids, n, None, temperature=0.0,
                                block_size=block_size, return_stats=True)
    return stats.output_ids[0, len(prompt):].tolist(), list(stats.acceptance_lengths)


def run_hf_generate(target, draft, prompt: list[int], n: int, block_size: int):
    """transformers greedy ``generate`` of exactly ``n`` tokens, target only."""
    del draft, block_size
    ids = torch.tensor([prompt], device=target.device)
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                              pad_token_id=0)
    return out[0, len(prompt):].tolist(), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny pair: a CPU wiring check")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (64 with --small)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--distill-steps", type=int, default=None,
                    help="fixture's CPU distillation of the drafter (default 200 small, 0 full)")
    args = ap.parse_args()
    wall0 = time.perf_counter()
    size = "small" if args.small else "full"
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    new_tokens = args.new_tokens or (64 if args.small else 128)
    target_kw, _, _, prompt_lens, default_distill = SIZES[size]
    distill = default_distill if args.distill_steps is None else args.distill_steps
    vocab = target_kw["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(0, vocab - 1) for _ in range(prompt_lens[i % len(prompt_lens)])]
               for i in range(args.num_prompts)]  # vocab - 1 is the drafter's mask token
    warm = [rng.randrange(0, vocab - 1) for _ in range(16)]
    warm_tokens = min(32, new_tokens)
    max_len = max(map(len, prompts)) + new_tokens + args.block_size + 16
    dev = args.device

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        target_dir, draft_dir = build_pair(Path(tmp), size, args.block_size, distill)
        build_s = time.perf_counter() - t0

        results: dict[str, dict] = {}  # name -> {tokens: [[...]], seconds, steps}

        # (a) the reference loop + (d) transformers generate, on the same loaded target
        ref = load_reference(target_dir, draft_dir, dev, dtype)
        for name, fn in (("dflash_generate (reference)", run_dflash_reference),
                         ("transformers generate, target-only", run_hf_generate)):
            fn(*ref, warm, warm_tokens, args.block_size)
            toks, secs, taus = [], 0.0, []
            for p in prompts:
                (out, step_taus), s = timed(
                    dev, functools.partial(fn, *ref, p, new_tokens, args.block_size))
                toks.append(out)
                secs += s
                taus += step_taus or []
            results[name] = dict(tokens=toks, seconds=secs,
                                 steps=len(taus) if taus else None,
                                 accepted=sum(taus) if taus else None)
        del ref
        if dev == "cuda":
            torch.cuda.empty_cache()

        # (b) our speculative engine, (c) our target-only engine
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        warm_params = SamplingParams(temperature=0, max_tokens=warm_tokens, ignore_eos=True)
        # no prefix caching: the timed prompts ran in the warm-up (the reference has no cache)
        common = dict(dtype=dtype_name, device=dev, max_model_len=max_len, max_num_seqs=1,
                      num_kv_blocks=(max_len // 16 + 2) * 2, enable_prefix_caching=False)
        for name, draft in (("laguna-dflash spec", draft_dir),
                            ("laguna-dflash target-only", None)):
            llm = LLM(str(target_dir), draft=str(draft) if draft else None,
                      num_speculative_tokens=args.block_size - 1 if draft else None, **common)
            # warm-up on the warm prompt and on every timed prompt's shape: CUDA graphs are captured
            # and torch.compile'd chains compiled per shape once, outside the timed runs
            for p in [warm] + prompts:
                llm.generate(prompt_token_ids=[p], sampling_params=warm_params)
            toks, secs, steps, accepted, raw_accepted = [], 0.0, 0, 0, 0
            for p in prompts:
                outs, s = timed(dev, functools.partial(llm.generate, prompt_token_ids=[p],
                                                       sampling_params=params))
                toks.append(outs[0].token_ids)
                secs += s
                m = outs[0].metrics
                if m:  # tokens per verify step, clipped to the budget like dflash reports it
                    steps += m["num_drafts"]
                    accepted += len(outs[0].token_ids) - 1  # the first token is the prefill's
                    raw_accepted += m["num_drafts"] + m["num_accepted_tokens"]
            results[name] = dict(tokens=toks, seconds=secs, steps=steps or None,
                                 accepted=accepted or None, raw_accepted=raw_accepted)
            del llm
            if dev == "cuda":
                torch.cuda.empty_cache()

    # agreement (common prefix per prompt) with our target-only output and with the reference
    ref_name = "dflash_generate (reference)"
    base = results["laguna-dflash target-only"]["tokens"]
    total = sum(len(t) for t in base)
    for r in results.values():
        r["match"] = sum(common_prefix(t, b) for t, b in zip(r["tokens"], base))
        r["match_ref"] = sum(common_prefix(t, b)
                             for t, b in zip(r["tokens"], results[ref_name]["tokens"]))
    ref_tps = sum(map(len, results[ref_name]["tokens"])) / results[ref_name]["seconds"]
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device {device_name}, dtype {dtype_name}, torch {torch.__version__}, size {size} "
          f"(hidden {target_kw['hidden_size']}, {target_kw['num_hidden_layers']} target layers, "
          f"vocab {vocab}), block {args.block_size}, {len(prompts)} prompts of "
          f"{[len(p) for p in prompts]} tokens x {new_tokens} new, batch 1, "
          f"drafter distill steps {distill}, pair built in {build_s:.1f}s\n")
    print("| implementation | tokens/s | mean acceptance length | verify steps "
          "| tokens = ours target-only | tokens = dflash_generate | ratio vs dflash_generate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        tps = sum(len(t) for t in r["tokens"]) / r["seconds"]
        # acceptance: generated tokens per verify step (the prefill token excluded); the
        # reference's per-step lengths are clipped to the budget on the last step, ours too
        tau = f"{r['accepted'] / r['steps']:.2f}" if r["steps"] else "-"
        steps = str(r["steps"]) if r["steps"] else "-"
        print(f"| {name} | {tps:.1f} | {tau} | {steps} | {r['match']}/{total} "
              f"| {r['match_ref']}/{total} | {tps / ref_tps:.2f} |")

    spec = results["laguna-dflash spec"]
    print(f"\nacceptance = generated tokens per verify step, the prefill token excluded, the "
          f"last step clipped to the budget (dflash's definition); our engine's own "
          f"mean_acceptance_length counts every accepted draft: "
          f"{spec['raw_accepted'] / spec['steps']:.2f}")

    exact = {n: r["match"] == total and sum(map(len, r["tokens"])) == total
             for n, r in results.items()}
    if dtype == torch.float32:
        must = ["laguna-dflash spec", ref_name]
        bad = [n for n in must if not exact[n]]
        if bad:
            raise SystemExit(f"float32 outputs differ from our target-only: {bad}")
        print("\nfloat32: our spec == our target-only == dflash_generate tokens (exact)"
              + ("" if exact["transformers generate, target-only"]
                 else "; transformers generate DIFFERS"))
    print(f"\ntotal wall time {time.perf_counter() - wall0:.1f}s")


if __name__ == "__main__":
    main()
