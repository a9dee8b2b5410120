"""Batch-invariant mode on the XS-2.1 pair: what it buys (bf16 token agreement) and what it costs.

One process, one engine (dummy weights, bf16 on CUDA), each mode in turn (``--modes``: the
default kernels, then ``EngineConfig.batch_invariant`` (its MoE kernels chosen by size,
``batch_invariant.moe_kernel = "auto"``), and on request that mode with one MoE kernel pair at
every size, ``batch-invariant-fused-moe`` / ``batch-invariant-sorted-moe``; the CUDA graphs are
rebuilt per mode):

* agreement: greedy tokens (and logprobs) of ``--prompts`` prompts of random token ids, lengths
  spread up to ``--context``, each ALONE (target-only, batch 1), all in one BATCH (target-only),
  and with DFLASH (K = 3, real verification, batched). Per run: prompts whose tokens differ from
  alone, the earliest differing token, prompts whose logprobs are not bitwise alone's.
* time: the target-only decode step at batch 1 and at ``--prompts``, the prefill of one
  ``--context`` prompt (the best of three), and DFlash tokens/s at simulated acceptance length 4 (K = 3, batch 1)
  over target-only tokens/s in the same mode (the issue-6 goal cell).

    python benchmarks/bench_batch_invariant.py                                  # H200
    python benchmarks/bench_batch_invariant.py --device cpu --layers 2 --hidden 256 \
        --context 40 --new-tokens 4 --prompts 3 --modes default                 # CPU wiring check
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
from pathlib import Path

from bench_gpu_xs import add_xs_pair_args, decode_tokens_per_s, prefill_time, step_time, xs_pair_llm

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.kernels import batch_invariant

# mode -> (EngineConfig.batch_invariant, batch_invariant.moe_kernel)
MODES = {"default": (False, "auto"), "batch-invariant": (True, "auto"),
         "batch-invariant-fused-moe": (True, "fused"), "batch-invariant-sorted-moe": (True, "sorted")}


def use_mode(mode: str) -> bool:
    """Set ``mode``'s invariant MoE kernels; -> its ``batch_invariant`` flag."""
    invariant, batch_invariant.moe_kernel = MODES[mode]
    return invariant


def set_mode(llm: LLM, invariant: bool) -> None:
    """Switch the engine's kernels; on CUDA drop its graphs (recaptured in the new mode)."""
    engine = llm.engine
    engine.config = dataclasses.replace(engine.config, batch_invariant=invariant)
    if invariant:
        batch_invariant.check_device(engine.device)
    if engine.runner.graphs is not None:
        engine.attach_graph_runners()


def set_drafter(llm: LLM, saved: tuple, k: int, simulated: float | None) -> None:
    """``k`` = 0: target-only (the drafter detached); else DFlash with ``k`` draft tokens."""
    engine = llm.engine
    engine.proposer, engine.tap_layer_ids = saved if k else (None, ())
    engine.num_speculative_tokens = k
    engine.simulated_acceptance, engine._sim_carry = simulated, 0.0


def agreement(llm: LLM, saved: tuple, prompts: list[list[int]], new_tokens: int) -> dict[str, tuple]:
    """Per run (batched, dflash): (prompts whose tokens differ from alone, earliest differing
    token index or None, prompts whose logprobs differ bitwise)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)

    def run(batches: list[list[list[int]]]) -> list[tuple]:
        return [(o.token_ids, o.logprobs) for b in batches
                for o in llm.generate(prompt_token_ids=b, sampling_params=params)]

    set_drafter(llm, saved, 0, None)
    alone, batched = run([[p] for p in prompts]), run([prompts])
    set_drafter(llm, saved, 3, None)
    dflash = run([prompts])
    out = {}
    for name, got in (("batched", batched), ("dflash", dflash)):
        firsts = [next((i for i, (x, y) in enumerate(zip(a[0], g[0])) if x != y), None)
                  for a, g in zip(alone, got)]
        parted = [f for f in firsts if f is not None]
        out[name] = (len(parted), min(parted) if parted else None,
                     sum(a[1] != g[1] for a, g in zip(alone, got)))
    return out


def timings(llm: LLM, saved: tuple, prompt: list[int], batch: int, new_tokens: int) -> dict[str, float]:
    set_drafter(llm, saved, 0, None)
    out = {"decode_b1_ms": step_time(llm, prompt, new_tokens) * 1e3,
           f"decode_b{batch}_ms": step_time(llm, prompt, new_tokens, batch) * 1e3,
           "prefill_ms": min(prefill_time(llm, prompt, 1) for _ in range(3)) * 1e3}
    decode_tokens_per_s(llm, prompt, new_tokens, 1)  # warm
    base = decode_tokens_per_s(llm, prompt, new_tokens, 1)
    set_drafter(llm, saved, 3, 4.0)
    decode_tokens_per_s(llm, prompt, new_tokens, 1)  # warm: the K = 3 graphs
    out["dflash_L4_speedup"] = decode_tokens_per_s(llm, prompt, new_tokens, 1) / base
    set_drafter(llm, saved, 3, None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the agreement runs (and the batch timed)")
    ap.add_argument("--agree-tokens", type=int, default=32, help="tokens a prompt in the agreement runs")
    ap.add_argument("--modes", default="default,batch-invariant", help=f"comma list of {', '.join(MODES)}")
    add_xs_pair_args(ap, new_tokens=64, rounds=1, new_tokens_help="tokens a request per timed run")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        span = args.context + max(args.new_tokens, args.agree_tokens) + 16
        llm, tcfg = xs_pair_llm(args, Path(tmp), span, args.prompts, num_speculative_tokens=3)
        vocab = tcfg["vocab_size"]
        saved = (llm.engine.proposer, llm.engine.tap_layer_ids)
        lengths = sorted(rng.randrange(9, args.context + 1) for _ in range(args.prompts - 1)) + [args.context]
        prompts = [[rng.randrange(100, vocab - 1) for _ in range(n)] for n in lengths]
        rows = []
        for mode in modes:
            set_mode(llm, use_mode(mode))
            agree = agreement(llm, saved, prompts, args.agree_tokens)
            times = {}
            for _ in range(args.rounds):
                for key, value in timings(llm, saved, prompts[-1], args.prompts, args.new_tokens).items():
                    better = max if key.endswith("speedup") else min
                    times[key] = better(value, times.get(key, value))
            rows.append((mode, agree, times))
    print(f"device {args.device}, layers {args.layers}, {args.prompts} prompts of 9..{args.context} "
          f"tokens x {args.agree_tokens} greedy tokens; timings: context {args.context}, "
          f"{args.new_tokens} tokens a run, best of {args.rounds}\n")
    print("| mode | batched: prompts parted / earliest token / logprobs differ | DFlash K=3: same | "
          f"decode b1 ms | decode b{args.prompts} ms | prefill ms | DFlash L=4 x target-only |")
    print("|---|---|---|---:|---:|---:|---:|")
    for mode, agree, t in rows:
        cells = [f"{n} / {first if first is not None else '-'} / {lp}" for n, first, lp in agree.values()]
        print(f"| {mode} | {cells[0]} | {cells[1]} | {t['decode_b1_ms']:.3f} | "
              f"{t[f'decode_b{args.prompts}_ms']:.3f} | {t['prefill_ms']:.1f} | {t['dflash_L4_speedup']:.2f}x |")


if __name__ == "__main__":
    main()
