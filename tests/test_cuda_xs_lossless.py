"""Lossless DFlash at the real Laguna-XS-2.1 layer widths on the GPU, through the whole engine.

The small pairs of ``test_cuda_graphs.py`` have shapes the tuned decode kernels (skinny GEMM
configs, GEMV MoE, split attention) never see. Here a 3-layer target with XS-2.1's widths (hidden
2048, 48 / 64 heads of 128, 8 KV heads, per-head gating, sliding and full layers; 16 experts,
vocab 4096) and the XS-2.1 drafter shape load dummy weights (seeded: both engines get the same
ones) in float32 with CUDA graphs: greedy DFlash (K = 3) gives target-only's tokens at batch 1
(a 700-token context, so decode attention splits its keys) and batch 3 (verify batches of 12
tokens: the skinny GEMM's dot path). Before the fp32 stage cap of ``skinny_gemm._dot_stages`` the
target-only engine already failed here (shared memory over the limit in the graph capture).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from laguna_dflash import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu_xs  # noqa: E402

_LAYERS = 3


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


def _tokens(llm: LLM) -> list[list[list[int]]]:
    rng = random.Random(0)
    long = [rng.randrange(100, 4000) for _ in range(700)]
    batches = [[long], [long[:300], [rng.randrange(100, 4000) for _ in range(40)], long[:9]]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [[o.token_ids for o in llm.generate(prompt_token_ids=b, sampling_params=params)] for b in batches]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_xs_widths_float32_dflash_equals_target_only(tmp_path):
    target, draft = _write_pair(tmp_path)
    common = dict(dtype="float32", device="cuda", load_format="dummy", max_model_len=1024,
                  max_num_seqs=4, num_kv_blocks=(1024 // 16 + 1) * 5)
    base = LLM(target, **common)
    assert base.engine.runner.graphs is not None
    want = _tokens(base)
    del base
    torch.cuda.empty_cache()
    spec = LLM(target, draft=draft, num_speculative_tokens=3, **common)
    assert _tokens(spec) == want
