"""CPU step costs of candidate demo-pair shapes: which target/drafter can reach 2x on a CPU?

For each candidate (random weights via ``load_format="dummy"``; costs do not depend on training),
batch 1, float32, one thread: the target-only decode step, and the DFlash step (draft + verify)
at K = 7 and K = 15, measured in the same run. ``break-even`` is the mean acceptance length at
which speculation only matches target-only; ``x@3.5`` the projected speedup at acceptance 3.5
(``3.5 * t_decode / t_step``).

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_step_cost.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.train.draft import DraftTrainConfig, draft_config
from laguna_dflash.train.target import TargetTrainConfig, demo_target_config

CANDIDATES = {
    # name: (target config overrides, drafter layers); "E8 x256" = 8 routed experts of
    # intermediate 256 (top-2) plus a shared expert of the same size
    "current (E8 x256, 6L)": (dict(), 2),
    "current, 1-layer drafter": (dict(), 1),
    "E4 x256, 6L": (dict(num_experts=4), 2),
    "E8 x128, 6L": (dict(moe_intermediate_size=128), 2),
    "E4 x128, 8L, 1-layer drafter": (dict(num_experts=4, moe_intermediate_size=128, num_layers=8), 1),
    "E4 x128, 12L, 1-layer drafter": (dict(num_experts=4, moe_intermediate_size=128, num_layers=12), 1),
}


def step_ms(llm: LLM, prompt: list[int], new_tokens: int = 48) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=params)  # warm-up
    before = llm.get_metrics()
    llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    after = llm.get_metrics()
    return 1e3 * (after["decode_s"] - before["decode_s"]) / (after["num_steps"] - before["num_steps"] - 1)


def main() -> None:
    torch.set_num_threads(1)
    prompt = list(range(10, 74))
    print(f"{'candidate':<32}{'params M':>9}{'decode ms':>10}{'K=7 ms':>8}{'K=15 ms':>9}"
          f"{'b-even7':>9}{'x@3.5 K7':>9}{'b-even15':>9}{'x@4.5 K15':>10}")
    for name, (overrides, draft_layers) in CANDIDATES.items():
        with tempfile.TemporaryDirectory() as tmp:
            cfg = demo_target_config(TargetTrainConfig(out_dir=tmp, **overrides))
            tdir, ddir = Path(tmp) / "t", Path(tmp) / "d"
            tdir.mkdir()
            ddir.mkdir()
            (tdir / "config.json").write_text(json.dumps(cfg))
            costs = {}
            for block in (8, 16):
                dcfg = draft_config(DraftTrainConfig(target=str(tdir), out_dir="", num_layers=draft_layers,
                                                     block_size=block), cfg)
                (ddir / "config.json").write_text(json.dumps(dcfg))
                spec = LLM(str(tdir), draft=str(ddir), load_format="dummy")
                costs[block - 1] = step_ms(spec, prompt)
            base = LLM(str(tdir), load_format="dummy")
            t0 = step_ms(base, prompt)
            params = sum(p.numel() for p in base.engine.target.parameters()) / 1e6
        print(f"{name:<32}{params:>9.1f}{t0:>10.2f}{costs[7]:>8.2f}{costs[15]:>9.2f}"
              f"{costs[7] / t0:>9.2f}{3.5 * t0 / costs[7]:>9.2f}{costs[15] / t0:>9.2f}"
              f"{4.5 * t0 / costs[15]:>10.2f}")


if __name__ == "__main__":
    main()
