"""Where a Laguna-XS-2.1-size prefill spends its time, per kernel, in each kernel mode.

Target only (dummy bf16 weights at the real shapes). For each mode (``--modes``: the default
kernels, ``EngineConfig.batch_invariant``, that mode with one MoE kernel pair at every size:
``batch-invariant-fused-moe`` / ``batch-invariant-sorted-moe``) one engine prefill of a ``--context``-token prompt is
timed (best of three, after a warm one) and profiled: GPU time per kernel name, summed, the
``--top`` largest printed with their share. The modes run in one process, one after the other.

    python benchmarks/profile_prefill_xs.py                     # H200: 40 layers, 1k prompt
    python benchmarks/profile_prefill_xs.py --device cpu --layers 2 --hidden 256 --context 64 \
        --modes default                                          # CPU wiring check
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from bench_batch_invariant import MODES, use_mode
from bench_gpu_xs import prefill_time, write_xs_configs

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.kernels import batch_invariant


def kernel_times(llm: LLM, prompt: list[int]) -> dict[str, float]:
    """GPU milliseconds per kernel name over one prefill (one token generated)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.cuda.is_available() and llm.config.device.startswith("cuda")
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1e3
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"):
            out[e.name] += e.self_cpu_time_total / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU wiring check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--modes", default="default,batch-invariant", help=f"comma list of {', '.join(MODES)}")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        tdir, _, tcfg = write_xs_configs(Path(tmp), args.layers, args.hidden)
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
        rng = random.Random(0)
        prompt = [rng.randrange(100, tcfg["vocab_size"] - 1) for _ in range(args.context)]
        for mode in modes:
            invariant = use_mode(mode)
            llm = LLM(str(tdir), dtype=dtype, device=args.device, load_format="dummy",
                      max_model_len=args.context + 16, max_num_seqs=1, enforce_eager=True,
                      batch_invariant=invariant)
            if invariant:
                batch_invariant.check_device(llm.engine.device)
            prefill_time(llm, prompt, 1)  # builds
            best = min(prefill_time(llm, prompt, 1) for _ in range(3))
            times = kernel_times(llm, prompt)
            total = sum(times.values())
            print(f"\n{mode}: prefill of {args.context} tokens {best * 1e3:.1f} ms (best of 3); "
                  f"profiled kernels {total:.1f} ms in {len(times)} names")
            print("| kernel | ms | share |\n|---|---:|---:|")
            for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"| {name} | {ms:.2f} | {ms / total:.0%} |")
            del llm
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
