"""What a reduced draft vocabulary (``--speculative-token-map``) costs in draft quality: the mean
acceptance length with token maps of several sizes against the whole vocabulary, greedy, and
how many outputs equal target-only's (all must: only the drafts change). Each map holds the most
frequent tokens of a corpus (``laguna-dflash token-map``'s counting); the table also gives the
share of the held-out outputs' tokens the map holds.

By default the embedded demo pair (4096 tokens) on its held-out prompts, the maps counted on its
training split (the interpreter's standard library, the held-out modules left out), on the CPU;
``--model`` / ``--draft`` / ``--data`` / ``--prompts`` run the same on a real pair, e.g.
Laguna-XS-2.1 and its drafter on one GPU with a code corpus. Prints a short table::

    python benchmarks/bench_token_map.py                                   # sizes 256..2048, K 3 and 7
    python benchmarks/bench_token_map.py --sizes 1024 --ks 3 --max-tokens 32
    python benchmarks/bench_token_map.py --model TARGET --draft DRAFT --data corpus/ --glob '*.py' \\
        --prompts prompts.jsonl --sizes 16384,32768 --device cuda --dtype bfloat16 --ks 3
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.bench import load_prompts
from laguna_dflash.demo import demo_pair, heldout_prompts
from laguna_dflash.models.draft_vocab import most_frequent_tokens, save_token_map
from laguna_dflash.token_map import (
    count_tokens,
    counting_tokenizer,
    iter_texts,
    model_vocab,
    token_coverage,
)
from laguna_dflash.train.data import stdlib_files


def acceptance(target: str, draft: str, prompts: list[str], params: SamplingParams, k: int,
               token_map: str | None, **engine_options) -> tuple[float, list[list[int]]]:
    """(mean acceptance length, each prompt's output tokens) of one engine."""
    llm = LLM(target, draft, num_speculative_tokens=k, speculative_token_map=token_map, **engine_options)
    outs = llm.generate(prompts, params)
    return llm.get_metrics()["mean_acceptance_length"], [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,512,1024,2048", help="token map sizes (comma list)")
    ap.add_argument("--ks", default="3,7", help="draft tokens K (comma list)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens a prompt")
    ap.add_argument("--model", help="target checkpoint directory (default: the demo pair's)")
    ap.add_argument("--draft", help="drafter checkpoint directory (with --model)")
    ap.add_argument("--data", nargs="+", help="corpus to count (default: the demo's training split)")
    ap.add_argument("--glob", default="*", help="files of --data directories to read")
    ap.add_argument("--max-bytes", type=int, default=None, help="characters of the corpus to count")
    ap.add_argument("--prompts", help="JSON list / JSON Lines of prompts (default: the demo's held-out set)")
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 (float32 keeps every "
                                                       "output target-only's in any batch)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if (args.model is None) != (args.draft is None):
        raise SystemExit("give --model and --draft together (a real pair), or neither (the demo pair)")
    target, draft = (args.model, args.draft) if args.model else demo_pair()
    data = args.data or [str(f) for f in stdlib_files("train")]
    prompts = load_prompts(args.prompts) if args.prompts else heldout_prompts()
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    sizes = [int(v) for v in args.sizes.split(",")]
    vocab_size, eos = model_vocab(target)
    counts = count_tokens(iter_texts(data, args.glob, args.max_bytes), counting_tokenizer(target), vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine_options = {"device": args.device, "dtype": args.dtype}
    base = [o.token_ids for o in LLM(target, **engine_options).generate(prompts, params)]
    held_out = torch.bincount(torch.tensor([t for tokens in base for t in tokens], dtype=torch.int64),
                              minlength=vocab_size)
    print(f"{target} with {draft}: {len(prompts)} prompts, greedy, {args.max_tokens} new tokens, "
          f"{args.device} {args.dtype}; maps of the most frequent tokens of {len(data)} corpus paths")
    print("| map tokens | of the outputs' tokens | K | acceptance length | whole vocabulary | change "
          "| outputs equal to target-only's |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        maps = {}
        for size in sizes:  # as `laguna-dflash token-map --num-tokens SIZE` writes it
            ids = most_frequent_tokens(counts, size, always=eos)
            maps[size] = (str(save_token_map(ids, Path(tmp) / f"map{size}.pt")), token_coverage(held_out, ids))
        for k in (int(v) for v in args.ks.split(",")):
            whole, _ = acceptance(target, draft, prompts, params, k, None, **engine_options)
            for size, (path, coverage) in maps.items():
                length, tokens = acceptance(target, draft, prompts, params, k, path, **engine_options)
                same = sum(a == b for a, b in zip(tokens, base))
                print(f"| {size} | {100 * coverage:.1f}% | {k} | {length:.4f} | {whole:.4f} "
                      f"| {100 * (length / whole - 1):+.2f}% | {same} of {len(prompts)} |")


if __name__ == "__main__":
    main()
