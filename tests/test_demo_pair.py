"""The embedded demo pair (assets/demo): size budget, lossless held-out decoding with real
acceptance, and the README's demo command.

The acceptance bar is the CI gate of issue #4: greedy, K = block_size - 1, on the held-out
prompts (modules never seen in training), mean acceptance length >= 2.5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.demo import demo_dir, demo_pair, heldout_prompts

MAX_DEMO_BYTES = 40_000_000
MIN_MEAN_ACCEPTANCE = 2.5
MAX_NEW_TOKENS = 128
REPO = Path(__file__).resolve().parents[1]


def test_demo_pair_fits_the_size_budget() -> None:
    files = [f for f in demo_dir().rglob("*") if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    assert total <= MAX_DEMO_BYTES, f"assets/demo holds {total} bytes (> {MAX_DEMO_BYTES})"
    names = {f.relative_to(demo_dir()).as_posix() for f in files}
    for required in ("target/config.json", "target/tokenizer.json", "draft/config.json"):
        assert required in names
    assert not any("/work/" in n or n.startswith("work/") for n in names), "training state shipped"


def test_demo_pair_is_the_laguna_flavour() -> None:
    target, draft = demo_pair()
    tcfg = json.loads((Path(target) / "config.json").read_text())
    dcfg = json.loads((Path(draft) / "config.json").read_text())
    assert tcfg["architectures"] == ["LagunaForCausalLM"]
    assert dcfg["architectures"] == ["DFlashLagunaForCausalLM"]
    assert {"full_attention", "sliding_attention"} <= set(tcfg["layer_types"])
    assert tcfg["num_experts"] > 1 and tcfg["shared_expert_intermediate_size"] > 0


@pytest.fixture(scope="module")
def heldout_runs():
    target, draft = demo_pair()
    prompts = heldout_prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    spec = LLM(target, draft=draft)
    spec_outs = spec.generate(prompts, params)
    base_outs = LLM(target).generate(prompts, params)
    return spec, spec_outs, base_outs


def test_heldout_speculative_output_equals_target_only(heldout_runs) -> None:
    spec, spec_outs, base_outs = heldout_runs
    assert spec.engine.num_speculative_tokens == spec.engine.drafter.block_size - 1
    assert len(spec_outs) == len(base_outs) == len(heldout_prompts())
    for s, b in zip(spec_outs, base_outs):
        assert len(s.token_ids) == MAX_NEW_TOKENS
        assert s.token_ids == b.token_ids


def test_heldout_mean_acceptance_length(heldout_runs) -> None:
    spec, _, _ = heldout_runs
    m = spec.get_metrics()
    assert m["num_drafts"] > 0
    assert m["mean_acceptance_length"] >= MIN_MEAN_ACCEPTANCE, m["mean_acceptance_length"]


def test_readme_demo_command() -> None:
    """`laguna-dflash generate "def quicksort(arr):"` with no --model uses the embedded pair."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "laguna_dflash", "generate", "def quicksort(arr):", "--max-new-tokens", "48"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def quicksort(arr):")
    assert len(proc.stdout) > len("def quicksort(arr):") + 20
    assert "mean acceptance length" in proc.stderr
    assert "target-only" in proc.stderr and "speedup" in proc.stderr
    assert "same tokens as target-only" in proc.stderr  # greedy: lossless, said on the line
    assert 'laguna-dflash generate "def quicksort(arr):"' in (REPO / "README.md").read_text()
