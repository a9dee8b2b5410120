"""What a structured-output constraint costs a decode step, apart from what it changes.

The XS-2.1-shaped pair (dummy weights, no tokenizer) decodes the same prompts free and under a
constraint that allows every token in every state (a synthetic byte spelling of the vocabulary,
``<id>``, and the regex ``[<>0-9]*``): the outputs must be the same tokens, so the difference
is the constraint's machinery alone: the automaton walk and the bit sets on the host, their
upload and unpacking, the masked copy of the logits, and (DFlash) the drafts' host copy each
verify step. Target-only and DFlash (simulated acceptance ``--length``), per batch size; the
best of ``--rounds`` timed runs after a warm-up run of the same shapes.

    python benchmarks/bench_structured_outputs.py --batches 1,4 --length 4 --rounds 3       # GPU
    python benchmarks/bench_structured_outputs.py --device cpu --layers 2 --hidden 256 \\
        --context 32 --new-tokens 6 --batches 1,2 --rounds 1                               # CPU wiring check
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from bench_gpu_xs import add_xs_pair_args, batch_prompts, sync, xs_pair_llm

from laguna_dflash import LLM, SamplingParams, StructuredOutputsParams
from laguna_dflash.structured_outputs import Grammar, terminated_vocabulary

ALLOW_ALL = "[<>0-9]*"


def allow_all_grammar(vocab_size: int) -> Grammar:
    """A grammar over ``vocab_size`` tokens, token ``i`` spelled ``<i>``, allowing them all
    (compiled as the engine's compiler compiles)."""
    spelled = {f"<{i}>".encode(): [i] for i in range(vocab_size)}
    return Grammar.from_regex(ALLOW_ALL, terminated_vocabulary(spelled, vocab_size), vocab_size)


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    """Decode tokens per second of one run of ``prompts`` (engine metrics), and its tokens."""
    before = llm.get_metrics()
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    sync(llm.config.device)
    after = llm.get_metrics()
    rate = (after["num_decode_tokens"] - before["num_decode_tokens"]) / (after["decode_s"] - before["decode_s"])
    return rate, [o.token_ids for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--length", type=float, default=4.0, help="simulated acceptance length L (DFlash rows)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens a DFlash step")
    add_xs_pair_args(ap, new_tokens=64, rounds=3, new_tokens_help="tokens a request per timed run")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        llm, tcfg = xs_pair_llm(args, Path(tmp), args.context + args.new_tokens + 2 * args.k + 16,
                                max(batches), num_speculative_tokens=args.k)
        engine = llm.engine
        proposer, taps = engine.proposer, engine.tap_layer_ids
        grammar = allow_all_grammar(tcfg["vocab_size"])
        free = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True,
                                     structured_outputs=StructuredOutputsParams(regex=ALLOW_ALL),
                                     structured_grammar=grammar)
        prompt = torch.randint(100, tcfg["vocab_size"] - 1, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        best: dict[tuple, float] = {}
        same: dict[tuple, bool] = {}
        for rnd in range(args.rounds + 1):  # round 0 warms every shape up, not kept
            for b in batches:
                for mode in ("target-only", "DFlash"):
                    dflash = mode == "DFlash"
                    engine.proposer, engine.tap_layer_ids = (proposer, taps) if dflash else (None, ())
                    engine.simulated_acceptance, engine._sim_carry = (args.length if dflash else None), 0.0
                    tokens = {}
                    for name, params in (("free", free), ("constrained", constrained)):
                        rate, tokens[name] = decode_rate(llm, batch_prompts(prompt, b), params)
                        if rnd:
                            best[b, mode, name] = max(rate, best.get((b, mode, name), 0.0))
                    same[b, mode] = same.get((b, mode), True) and tokens["free"] == tokens["constrained"]
        engine.proposer, engine.tap_layer_ids, engine.simulated_acceptance = proposer, taps, None
    print(f"\ndecode tok/s, free and under an allow-all constraint ({args.layers} layers, context "
          f"{args.context}, {args.new_tokens} new tokens; DFlash K = {args.k} at simulated L = {args.length:g})\n")
    print("| batch | mode | free tok/s | constrained tok/s | ratio | same tokens |")
    print("|---:|---|---:|---:|---:|---|")
    for b in batches:
        for mode in ("target-only", "DFlash"):
            f, c = best[b, mode, "free"], best[b, mode, "constrained"]
            print(f"| {b} | {mode} | {f:.1f} | {c:.1f} | {c / f:.3f} | {'yes' if same[b, mode] else 'NO'} |")


if __name__ == "__main__":
    main()
