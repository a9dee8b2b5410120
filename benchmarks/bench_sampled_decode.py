"""Decode tokens/s when requests sample (temperature > 0) against greedy, target-only and DFlash.

Every decode number so far was greedy. Here the XS-2.1 pair (dummy weights at the real shapes,
bench_gpu_xs.py's builders, bf16, the engine's defaults) decodes with four sampling modes:

* ``greedy``: temperature 0 (the baseline of the ratios);
* ``temp``: temperature 0.7, no filters;
* ``top-p``: temperature 0.7, top_p 0.95, top_k 50;
* ``seeded``: temperature 0.7, top_p 0.95, a distinct seed per request (its noise then comes
  from the counter-based generator at its output positions, every seeded row of a step in one
  launch, engine/sampler.py).

Per batch size (``--batches``) two engine setups on the same weights: target-only (the drafter
detached, as bench_gpu_xs.py's target-only cells) and DFlash with K = ``--k`` drafts a step at a
simulated acceptance length L = ``--sim-length`` (SGLang's SIMULATE_ACC_LEN: L - 1 drafts
accepted a step without checking, so every mode accepts the same and only the sampling differs).
Each request gets its own random prompt: identical prompts would decode identical greedy tokens
and route every row of a batch to the same experts, a cheaper MoE step than the diverging rows
of the sampled modes. A cell's rate is the tokens delivered in the decode phase (prompt tokens
and the prefill's first token left out) over the engine's decode wall time. Round 0 warms every
shape up and is not kept; then ``--rounds`` timed rounds interleave the modes (their order
rotating each round) so that drift hits every mode alike, and each cell keeps its best round.

With ``--switch module:attr=value`` (repeatable) every sampled mode is timed again with the
switch set, in the same rounds, as a column of its own (``seeded (sort_narrow_keys=False)``):
an end-to-end A/B of a sampler option against the defaults and greedy of the same run.

The claim is the ratios within one run (sampled mode over greedy of the same row), not the
absolute rates (dummy weights, one host's clocks).

    python benchmarks/bench_sampled_decode.py                                     # H200
    python benchmarks/bench_sampled_decode.py --device cpu --layers 2 --hidden 256 \
        --context 32 --new-tokens 5 --batches 1,2 --rounds 1                    # CPU wiring check
    python benchmarks/bench_sampled_decode.py --modes seeded --batches 64 \
        --switch laguna_dflash.engine.sampler:sort_narrow_keys=False              # an A/B
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu_xs import add_xs_pair_args, switch_error, sync, xs_pair_llm
from host_timeline import switched

from laguna_dflash import LLM, SamplingParams

#: the sampling modes, in table order (greedy first: the ratios' baseline)
MODES = {
    "greedy": dict(temperature=0.0),
    "temp": dict(temperature=0.7),
    "top-p": dict(temperature=0.7, top_p=0.95, top_k=50),
    "seeded": dict(temperature=0.7, top_p=0.95),  # + seed=i for request i
}


def mode_params(mode: str, batch: int, new_tokens: int) -> list[SamplingParams]:
    """One SamplingParams per request of ``mode``; ``seeded`` gives request ``i`` seed ``i``."""
    fields = dict(MODES[mode], max_tokens=new_tokens, ignore_eos=True)
    return [SamplingParams(**fields, seed=i if mode == "seeded" else None) for i in range(batch)]


def decode_rate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    """Decode-phase tokens/s of one request per prompt: the tokens delivered after each
    request's first (the prefill's) over the engine's decode wall time. Delivered, not the
    engine's ``num_decode_tokens``: a last DFlash step may emit past ``max_tokens``, which it
    counts."""
    before = llm.get_metrics()["decode_s"]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    sync(llm.config.device)
    seconds = llm.get_metrics()["decode_s"] - before
    return sum(len(o.token_ids) - 1 for o in outputs) / seconds


def parse_positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers "
                                         "(e.g. 1,16,64)") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every batch size must be >= 1")
    return values


def parse_modes(text: str) -> list[str]:
    """``"greedy,top-p"`` -> the modes in table order; greedy is always timed (the baseline)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(map(repr, bad)) or repr(text)}; "
                                         f"choose from {', '.join(MODES)} (comma separated)")
    return [m for m in MODES if m == "greedy" or m in names]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=parse_positive_ints, default=[1, 16, 64], help="batch sizes (default 1,16,64)")
    ap.add_argument("--modes", type=parse_modes, default=list(MODES),
                    help=f"sampling modes to time, comma separated, of {', '.join(MODES)} (default all; "
                         "greedy is always timed: the ratios' baseline)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens a step of the DFlash rows")
    ap.add_argument("--sim-length", type=float, default=4.0,
                    help="simulated acceptance length L of the DFlash rows (1 <= L <= K + 1)")
    ap.add_argument("--switch", action="append", default=[], metavar="MODULE:ATTR=VALUE",
                    help="time every sampled mode again with this set, as its own column "
                         "(repeatable; e.g. laguna_dflash.engine.sampler:sort_narrow_keys=False)")
    ap.add_argument("--progress", action="store_true",
                    help="print each cell as it is timed (a run cut short keeps them)")
    add_xs_pair_args(ap, new_tokens=128, rounds=2, new_tokens_help="tokens a request a timed run")
    args = ap.parse_args(argv)
    if args.k < 1:
        ap.error(f"argument --k: must be >= 1 (the DFlash rows draft K tokens a step), got {args.k}")
    if not 1.0 <= args.sim_length <= args.k + 1:
        ap.error(f"argument --sim-length: must be in [1, K + 1 = {args.k + 1}] (--k {args.k}), "
                 f"got {args.sim_length:g}")
    if args.rounds < 1:
        ap.error(f"argument --rounds: must be >= 1, got {args.rounds}")
    if args.new_tokens < 2:
        ap.error(f"argument --new-tokens: must be >= 2 (the first token is the prefill's), got {args.new_tokens}")
    if args.context < 1:
        ap.error(f"argument --context: must be >= 1, got {args.context}")
    for text in args.switch:  # parsed and imported now, not after the pair is built
        if error := switch_error(text):
            ap.error(f"argument --switch: {error}, e.g. laguna_dflash.engine.sampler:sort_narrow_keys=False")
    return args


def columns_of(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """The timed cells of a row, in table order: (label, mode, switch or None); greedy first,
    then each sampled mode, then each switch's sampled modes."""
    sampled = [m for m in args.modes if m != "greedy"]
    return ([(m, m, None) for m in args.modes]
            + [(f"{m} ({s.split(':', 1)[-1]})", m, s) for s in args.switch for m in sampled])


def rows_of(args: argparse.Namespace) -> list[str]:
    return ["target-only", f"DFlash K={args.k} L={args.sim_length:g}"]


def run(args: argparse.Namespace) -> dict[tuple[int, str, str], float]:
    """Time every (batch, row, mode) cell -> its best tokens/s over the timed rounds."""
    batches, columns, rows = args.batches, columns_of(args), rows_of(args)
    best: dict[tuple[int, str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        span = args.context + args.new_tokens + 2 * args.k + 16
        t0 = time.perf_counter()
        llm, tcfg = xs_pair_llm(args, Path(tmp), span, max(batches), num_speculative_tokens=args.k)
        print(f"(pair built in {time.perf_counter() - t0:.1f}s)", flush=True)
        engine = llm.engine
        proposer, taps = engine.proposer, engine.tap_layer_ids
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, tcfg["vocab_size"] - 1, (args.context,), generator=gen).tolist()
                   for _ in range(max(batches))]
        try:
            for rnd in range(args.rounds + 1):  # round 0 warms every shape up, not kept
                t_round = time.perf_counter()
                order = columns[rnd % len(columns):] + columns[: rnd % len(columns)]
                for b in batches:
                    for row in rows:
                        dflash = row != "target-only"
                        # target-only on the same weights: the drafter detached (bench_gpu_xs.py)
                        engine.proposer, engine.tap_layer_ids = (proposer, taps) if dflash else (None, ())
                        engine.simulated_acceptance = args.sim_length if dflash else None
                        for label, mode, switch in order:
                            engine._sim_carry = 0.0
                            with switched([switch] if switch else []):
                                rate = decode_rate(llm, prompts[:b], mode_params(mode, b, args.new_tokens))
                            if rnd:
                                best[b, row, label] = max(rate, best.get((b, row, label), 0.0))
                            if args.progress:
                                print(f"(round {rnd}{' warm-up' if not rnd else ''}: batch {b}, {row}, "
                                      f"{label}: {rate:.1f} tok/s)", flush=True)
                print(f"(round {rnd}{' (warm-up, not kept)' if not rnd else ''} done in "
                      f"{time.perf_counter() - t_round:.1f}s)", flush=True)
        finally:
            engine.proposer, engine.tap_layer_ids = proposer, taps
            engine.simulated_acceptance = None
    return best


def format_table(args: argparse.Namespace, best: dict[tuple[int, str, str], float]) -> str:
    """The markdown table: a row per batch x engine setup, greedy tok/s then each sampled mode's
    tok/s (x greedy of the same row)."""
    sampled = [label for label, mode, _ in columns_of(args) if mode != "greedy"]
    lines = ["| batch | decode | greedy tok/s | " + " | ".join(f"{m} tok/s (x greedy)" for m in sampled) + " |",
             "|---:|---|---:|" + "---:|" * len(sampled)]
    for b in args.batches:
        for row in rows_of(args):
            base = best[b, row, "greedy"]
            cells = [f"{best[b, row, m]:.1f} ({best[b, row, m] / base:.2f}x)" for m in sampled]
            lines.append(f"| {b} | {row} | {base:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    best = run(args)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\ndevice {name}, torch {torch.__version__}, layers {args.layers}, context {args.context}, "
          f"{args.new_tokens} tokens a request a run, {args.rounds} timed rounds (best kept)")
    print("modes: " + "; ".join(f"{m} {MODES[m]}" + (" + seed i for request i" if m == "seeded" else "")
                                for m in args.modes) + "\n")
    print(format_table(args, best))


if __name__ == "__main__":
    main()
