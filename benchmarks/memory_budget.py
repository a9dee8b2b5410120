"""Where an engine's GPU memory goes at start-up, for one memory setting (one process each):

    python benchmarks/memory_budget.py                                   # default: 80% of free
    python benchmarks/memory_budget.py --option gpu_memory_utilization=0.9
    python benchmarks/memory_budget.py --option mem_fraction_static=0.9

The XS-2.1 pair (dummy weights, bf16, K = 3) at the server's defaults (64 sequences, 8192
tokens). Prints the engine's KV-budget line (in use after load, torch's share of it, the
profiled activations), the cache it got, and the memory in use after start-up; then serves
``--prompts`` prompts of ``--prompt-len`` tokens and prints torch's peak.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from bench_first_request import option_value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU wiring check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--option", action="append", default=[],
                    help="extra LLM keyword, NAME=VALUE (int, float, true/false, none or text)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("laguna_dflash.engine").setLevel(logging.INFO)
    import torch
    from bench_gpu_xs import write_xs_configs

    from laguna_dflash import LLM, SamplingParams
    from laguna_dflash.engine.kv_cache import KVCache

    options = {name: option_value(value) for name, _, value in
               (item.partition("=") for item in args.option)}
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir, tcfg = write_xs_configs(Path(tmp), args.layers, args.hidden)
        t0 = time.perf_counter()
        llm = LLM(str(tdir), draft=str(ddir) if args.k else None, dtype="bfloat16" if cuda else "float32",
                  device=args.device, load_format="dummy", max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, num_speculative_tokens=args.k or None, **options)
        startup_s = time.perf_counter() - t0
    engine = llm.engine
    caches = [engine.runner.kv_cache] + ([engine.proposer.kv_cache] if engine.proposer else [])
    kv_gib = KVCache.num_bytes(*caches) / 2**30  # pooled layers counted once
    print(f"options {options}: start-up {startup_s:.1f} s, KV cache {engine.allocator.num_blocks} "
          f"blocks ({kv_gib:.1f} GiB), profiled activations {engine.profiled_activation_bytes / 2**30:.2f} GiB")
    if not cuda:
        return
    free, total = torch.cuda.mem_get_info()
    print(f"after start-up: in use {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB; torch "
          f"allocated {torch.cuda.memory_allocated() / 2**30:.1f}, reserved "
          f"{torch.cuda.memory_reserved() / 2**30:.1f}, start-up's peak reserved "
          f"{torch.cuda.max_memory_reserved() / 2**30:.1f} (allocated "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f})")
    torch.cuda.reset_peak_memory_stats()  # the serving's own peaks below
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(args.prompt_len)] for i in range(args.prompts)]
    llm.generate(prompt_token_ids=prompts,
                 sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    free, total = torch.cuda.mem_get_info()
    print(f"after {args.prompts} x {args.prompt_len} tokens: in use {(total - free) / 2**30:.1f} GiB; "
          f"torch's peak reserved {torch.cuda.max_memory_reserved() / 2**30:.1f}, peak allocated "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
