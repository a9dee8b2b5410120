"""Lossless DFlash at the real Laguna-XS-2.1 and S-2.1 layer widths on the GPU, through the whole engine.

The small pairs of ``test_cuda_graphs.py`` have shapes the tuned decode kernels (skinny GEMM
configs, GEMV MoE, split attention) never see. Here a 3-layer target with XS-2.1's widths (hidden
2048, 48 / 64 heads of 128, 8 KV heads, per-head gating, sliding and full layers; 16 experts,
vocab 4096) and the XS-2.1 drafter shape load dummy weights (seeded: both engines get the same
ones) in float32 with CUDA graphs: greedy DFlash (K = 3) gives target-only's tokens at batch 1
(a 700-token context, so decode attention splits its keys) and batch 3 (verify batches of 12
tokens: the skinny GEMM's dot path). Before the fp32 stage cap of ``skinny_gemm._dot_stages`` the
target-only engine already failed here (shared memory over the limit in the graph capture).
The S-2.1 case (hidden 3072, 48 / 72 heads: GQA 6 and 9; top-10 routing + shared, experts of
1024; its 6-layer, 72-head drafter) runs the same checks at the widths of the larger model,
which the tuned configs and the routing's top-k were not written around.
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
import bench_tp  # noqa: E402

_LAYERS = 3
_CONFIGS = {"xs21": (bench_gpu_xs.xs_target_config, bench_gpu_xs.xs_draft_config),
            "s21": (bench_tp.s21_target_config, bench_tp.s21_draft_config)}


def _write_pair(root: Path, widths: str) -> tuple[str, str]:
    target_config, draft_config = _CONFIGS[widths]
    tcfg, dcfg = target_config(_LAYERS), draft_config(_LAYERS)
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


def test_s21_configs_hold_the_widths_that_set_s21_apart(tmp_path):
    """The S-2.1 case's configs carry what distinguishes S-2.1 (so the CUDA case tests it)."""
    target, draft = (json.loads((Path(d) / "config.json").read_text()) for d in _write_pair(tmp_path, "s21"))
    assert target["hidden_size"] == draft["hidden_size"] == 3072
    assert target["num_attention_heads_per_layer"] == [48, 72, 72]
    assert (target["num_experts_per_tok"], target["moe_intermediate_size"]) == (10, 1024)
    assert draft["num_attention_heads"] == 72 and draft["num_hidden_layers"] == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("widths", ["xs21", "s21"])
def test_xs_widths_float32_dflash_equals_target_only(tmp_path, monkeypatch, widths):
    """Also counts the launches of the Q|K|V|gate GEMM with the Q/K norm, RoPE and K/V write in
    its epilogue (kernels/qkv_norm_rope_cache.py; the default in graphs of
    ``Attention.fuse_qk_min_tokens`` to 16 tokens): the check covers it only if it runs at
    decode (1 token) and at verify / drafter sizes."""
    from laguna_dflash.kernels import qkv_norm_rope_cache

    rows = []
    fused = qkv_norm_rope_cache.qkv_norm_rope_cache

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return fused(x, *args, **kwargs)

    monkeypatch.setattr(qkv_norm_rope_cache, "qkv_norm_rope_cache", counted)
    target, draft = _write_pair(tmp_path, widths)
    common = dict(dtype="float32", device="cuda", load_format="dummy", max_model_len=1024,
                  max_num_seqs=4, num_kv_blocks=(1024 // 16 + 1) * 5)
    base = LLM(target, **common)
    assert base.engine.runner.graphs is not None
    want = _tokens(base)
    del base
    torch.cuda.empty_cache()
    spec = LLM(target, draft=draft, num_speculative_tokens=3, **common)
    assert _tokens(spec) == want
    assert 1 in rows and max(rows) > 1, sorted(set(rows))
