"""The adaptive-K engine against fixed K, interleaved in one process, with what its steps did.

``bench_gpu_xs.py --adaptive`` times the adaptive cells after all the fixed ones, a single
round: at batch 16 and 64 with no draft accepted it measured 0.96x / 0.99x target-only where
K = 0 gave 1.00x (docs/PERFORMANCE.md, nineteenth pass). This script says whether that is the
policy or the drift of the call: per round and batch size it times target-only (no drafter),
fixed K = 0 and fixed K = ``--fixed-k`` (drafter loaded), and the adaptive engine (a fresh
policy, one learning run, then the timed run), at one simulated acceptance length; the minimum
of the rounds is kept (round 0 warms up every shape and is not kept). For the adaptive engine it
also counts, in its timed runs: steps by K, the steps that took a forward queued ahead, and the
drafter blocks queued ahead that no step used.

    python benchmarks/bench_adaptive_ab.py --batches 1,16,64 --length 1 --rounds 2   # H200
    python benchmarks/bench_adaptive_ab.py --device cpu --layers 2 --hidden 256 \
        --context 32 --new-tokens 6 --batches 1,2 --rounds 1                       # CPU wiring check
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import torch
from bench_gpu_xs import add_xs_pair_args, decode_tokens_per_s, xs_pair_llm

from laguna_dflash.engine.adaptive_k import AdaptiveK
from laguna_dflash.engine.ahead import DraftsAhead


class StepLog:
    """Counts what an engine's decode steps did (its step methods wrapped; ``reset`` per run)."""

    def __init__(self, engine) -> None:
        self.ks: Counter = Counter()  # steps by K (0: target-only)
        self.num_ahead_taken = 0  # K = 0 steps whose batch a forward queued ahead covered
        self.num_drafts_unused = 0  # drafter blocks queued ahead, then a K = 0 step
        decode, spec, run = engine._decode, engine._spec_decode, engine._run

        def decode_spy(seqs, ahead=None):
            self.ks[0] += 1
            self.num_ahead_taken += ahead is not None and ahead.rows_for(seqs) is not None
            return decode(seqs, ahead)

        def spec_spy(seqs, k, ahead=None):
            self.ks[k] += 1
            return spec(seqs, k, ahead)

        def run_spy(batch):
            drafts_queued, decodes = isinstance(engine._ahead, DraftsAhead), self.ks[0]
            out = run(batch)
            self.num_drafts_unused += drafts_queued and self.ks[0] > decodes
            return out

        engine._decode, engine._spec_decode, engine._run = decode_spy, spec_spy, run_spy

    def reset(self) -> None:
        self.ks.clear()
        self.num_ahead_taken = self.num_drafts_unused = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--length", type=float, default=1.0, help="simulated acceptance length L")
    ap.add_argument("--fixed-k", type=int, default=3, help="the fixed K > 0 row")
    ap.add_argument("--max-k", type=int, default=15, help="the adaptive engine's K_max")
    add_xs_pair_args(ap, new_tokens=256, rounds=2, new_tokens_help="tokens a request per timed run")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        span = args.context + args.new_tokens + 2 * args.max_k + 16
        llm, tcfg = xs_pair_llm(args, Path(tmp), span, max(batches), num_speculative_tokens=args.max_k)
        engine = llm.engine
        proposer, taps = engine.proposer, engine.tap_layer_ids
        log = StepLog(engine)
        prompt = torch.randint(100, tcfg["vocab_size"] - 1, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        variants = ["target-only", "fixed K = 0", f"fixed K = {args.fixed_k}", "adaptive"]
        best: dict[tuple[int, str], float] = {}
        diag: dict[int, tuple] = {}
        for rnd in range(args.rounds + 1):  # round 0 warms every shape up, not kept
            for b in batches:
                for name in variants:
                    drafter = name != "target-only"
                    engine.proposer, engine.tap_layer_ids = (proposer, taps) if drafter else (None, ())
                    engine.simulated_acceptance, engine._sim_carry = args.length, 0.0
                    engine.k_policy = None
                    if name == "adaptive":
                        engine.num_speculative_tokens = args.max_k
                        engine.k_policy = AdaptiveK(args.max_k)
                        decode_tokens_per_s(llm, prompt, args.new_tokens, b)  # the policy learns
                    else:
                        engine.num_speculative_tokens = {"fixed K = 0": 0}.get(name, args.fixed_k)
                    log.reset()
                    rate = decode_tokens_per_s(llm, prompt, args.new_tokens, b)
                    if rnd:
                        best[b, name] = max(rate, best.get((b, name), 0.0))
                        if name == "adaptive":
                            diag[b] = (dict(sorted(log.ks.items())), log.num_ahead_taken,
                                       log.num_drafts_unused)
        engine.proposer, engine.tap_layer_ids, engine.k_policy = proposer, taps, None
        print(f"device {args.device}, layers {args.layers}, context {args.context}, L = {args.length:g}, "
              f"{args.new_tokens} tokens a request a run, {args.rounds} rounds (best kept)\n")
        print("| batch | " + " | ".join(f"{v} tok/s (x target-only)" for v in variants) + " |")
        print("|---:|" + "---:|" * len(variants))
        for b in batches:
            base = best[b, "target-only"]
            print(f"| {b} | " + " | ".join(f"{best[b, v]:.1f} ({best[b, v] / base:.3f}x)" for v in variants) + " |")
        print("\n| batch | adaptive, last timed run: steps by K | K = 0 steps taking a forward queued "
              "ahead | drafter blocks queued ahead, unused |\n|---:|---|---:|---:|")
        for b in batches:
            ks, taken, unused = diag[b]
            print(f"| {b} | {ks} | {taken} of {ks.get(0, 0)} | {unused} |")


if __name__ == "__main__":
    main()
