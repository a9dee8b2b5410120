"""Decode-path kernel switches at the real Laguna-XS-2.1 layer widths, through the whole engine.

The small test pairs of ``test_cuda_graphs.py`` have shapes the skinny GEMM is not tuned for, so
the layer fusions that ride on it never run there. Here a 3-layer target with XS-2.1's widths
(hidden 2048, 48 / 64 heads of 128, 8 KV heads, per-head gating; 16 experts, vocab 4096) and the
XS-2.1 drafter shape load dummy weights (seeded: every engine gets the same ones) in float32,
and each switch is checked where it runs (CUDA graphs, batch 1 and 3, a 700-token context so
batch-1 attention splits its keys):

* target-only decoding with the switch on gives the defaults' greedy tokens;
* DFlash (K = 3) with the switch on gives the defaults' target-only tokens: lossless.

Both also assert the switched code path was taken during the graph capture.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from laguna_dflash import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu_xs  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (module, attribute, value, the function whose calls show the switched path ran)
SWITCHES = [
    ("laguna_dflash.models.layers", "fuse_o_proj_norm", True,
     ("laguna_dflash.kernels.skinny_gemm", "skinny_gemm_add_rms_norm")),
    ("laguna_dflash.models.layers", "fuse_moe_norm", True,
     ("laguna_dflash.kernels.moe_gemv", "moe_gemv_experts_add_rms_norm")),
]
_LAYERS = 3
_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _write_pair(root: Path) -> tuple[str, str]:
    tcfg, dcfg = bench_gpu_xs.xs_target_config(_LAYERS), bench_gpu_xs.xs_draft_config(_LAYERS)
    for cfg in (tcfg, dcfg):
        cfg["vocab_size"] = 4096
    dcfg["draft_vocab_size"] = 4096
    tcfg["num_experts"] = 16
    dirs = []
    for name, cfg in (("target", tcfg), ("draft", dcfg)):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg))
        dirs.append(str(root / name))
    return dirs[0], dirs[1]


def _prompts() -> list[list[list[int]]]:
    rng = random.Random(0)
    long = [rng.randrange(100, 4000) for _ in range(700)]
    return [[long], [long[:300], [rng.randrange(100, 4000) for _ in range(40)], long[:9]]]


def _llm(target: str, draft: str | None) -> LLM:
    kw = dict(draft=draft, num_speculative_tokens=3) if draft else {}
    return LLM(target, dtype="float32", device="cuda", load_format="dummy", max_model_len=1024,
               max_num_seqs=4, num_kv_blocks=(1024 // 16 + 1) * 5, **kw)


def _tokens(llm: LLM) -> list[list[list[int]]]:
    return [[o.token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=_PARAMS)]
            for batch in _prompts()]


@pytest.fixture(scope="module")
def pair_and_defaults(tmp_path_factory):
    target, draft = _write_pair(tmp_path_factory.mktemp("xs"))
    base = _llm(target, None)
    want = _tokens(base)
    del base
    torch.cuda.empty_cache()
    return target, draft, want


@needs_cuda
@pytest.mark.parametrize("module,attr,value,probe", SWITCHES, ids=[s[1] for s in SWITCHES])
def test_xs_widths_switch_keeps_the_tokens(pair_and_defaults, module, attr, value, probe, monkeypatch):
    target, draft, want = pair_and_defaults
    monkeypatch.setattr(importlib.import_module(module), attr, value)
    probe_module = importlib.import_module(probe[0])
    original = getattr(probe_module, probe[1])
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(probe_module, probe[1], counted)
    for use_draft in (False, True):
        calls.clear()
        llm = _llm(target, draft if use_draft else None)
        got = _tokens(llm)
        assert calls, f"{probe[1]} never ran with {attr}={value}"
        assert got == want, f"{attr}={value}, {'DFlash K=3' if use_draft else 'target-only'}"
        del llm
        torch.cuda.empty_cache()
