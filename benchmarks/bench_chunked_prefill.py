"""What chunked prefill buys a running request: the longest wait between its tokens while a long
prompt is prefilled, with and without chunking, in one process (Laguna-XS-2.1-shaped target,
dummy weights; bf16 on CUDA, float32 on the CPU).

One request decodes; a ``--context``-token prompt arrives; both run until the long prompt has its
first token. Per variant (the best of ``--rounds``): the running request's longest gap between
two engine steps that gave it tokens, its tokens during the long prefill, the long prompt's time
to first token, and whether its first tokens equal the unchunked ones::

    python benchmarks/bench_chunked_prefill.py                              # H200, 40 layers
    python benchmarks/bench_chunked_prefill.py --device cpu --layers 4 --hidden 256 \\
        --context 2048 --chunks 256,512
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu_xs import write_xs_configs

from laguna_dflash import LLM, SamplingParams


def one_run(llm: LLM, short: list[int], long: list[int], new_tokens: int) -> dict:
    """The running request's longest token gap (s) and its tokens while ``long`` prefills, and
    ``long``'s time to first token (s) and first ``new_tokens`` tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    running = engine.add_request(short, params)
    for _ in range(3):  # prefilled and decoding
        engine.step()
    arrived = time.perf_counter()
    tail = engine.add_request(long, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                   ignore_eos=True))
    before, last, gap = len(running.output_token_ids), arrived, 0.0
    first_token_s = None
    while first_token_s is None:  # the long prompt's prefill
        count = len(running.output_token_ids)
        engine.step()
        now = time.perf_counter()
        got = len(running.output_token_ids) > count
        if got or tail.output_token_ids:  # the running request's wait, up to here
            gap = max(gap, now - last)
            last = now if got else last
        if tail.output_token_ids:
            first_token_s = now - arrived
    during = len(running.output_token_ids) - before
    engine.abort(running)
    while engine.has_unfinished:
        engine.step()
    return {"gap_s": gap, "ttft_s": first_token_s, "tokens_during": during,
            "tail": list(tail.output_token_ids)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=8192, help="the long prompt's tokens")
    ap.add_argument("--chunks", default="512,2048", help="max_num_batched_tokens values to time")
    ap.add_argument("--new-tokens", type=int, default=8, help="the long prompt's tokens to compare")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    variants = [("whole prompt (no chunking)", False, args.context)]
    variants += [(f"chunks of {c}", True, int(c)) for c in args.chunks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tdir, _, cfg = write_xs_configs(Path(tmp), args.layers, args.hidden)
        short = [rng.randrange(3, cfg["vocab_size"]) for _ in range(32)]
        long = [rng.randrange(3, cfg["vocab_size"]) for _ in range(args.context)]
        want = None
        for name, chunked, budget in variants:
            llm = LLM(str(tdir), dtype=dtype, device=args.device, load_format="dummy",
                      max_model_len=args.context + 64, max_num_seqs=4,
                      max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                      enable_prefix_caching=False, cuda_graph_capture="lazy")
            runs = [one_run(llm, short, long, args.new_tokens) for _ in range(args.rounds + 1)][1:]
            best = min(runs, key=lambda r: r["gap_s"])
            want = want if want is not None else best["tail"]
            rows.append((name, best, all(r["tail"] == want for r in runs)))
            del llm
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# {device}, XS-2.1-shaped target ({args.layers} layers, hidden {args.hidden}), "
          f"{dtype}, a {args.context}-token prompt arriving while one request decodes; best of "
          f"{args.rounds} after a warm-up run")
    print("| prefill | longest gap between the running request's tokens ms | its tokens during "
          "the prefill | long prompt's TTFT ms | first tokens = unchunked |")
    print("|---|---:|---:|---:|---|")
    for name, r, same in rows:
        print(f"| {name} | {r['gap_s'] * 1e3:.1f} | {r['tokens_during']} | "
              f"{r['ttft_s'] * 1e3:.1f} | {same} |")


if __name__ == "__main__":
    main()
