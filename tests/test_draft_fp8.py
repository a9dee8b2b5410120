"""Weight-only fp8 for the drafter (``models/fp8.py``, ``draft_quantization="fp8"``).

The quantizer's rounding bound, the layers it replaces, its CPU path (the dequantized weight:
the same values the GPU's skinny GEMM streams), and the engine: with the demo pair's trained
drafter in fp8, greedy speculative output is still token for token the target's, and the
acceptance stays near the unquantized drafter's. The kernel itself: test_kernel_skinny_fp8.py.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from laguna_dflash.config import SamplingParams, SpeculativeConfig
from laguna_dflash.demo import demo_pair, heldout_prompts
from laguna_dflash.kernels import skinny_gemm
from laguna_dflash.llm import LLM
from laguna_dflash.models import layers
from laguna_dflash.models.fp8 import FP8_MAX, Fp8Linear, dequantize_rows, fp8_linear, quantize_rows
from laguna_dflash.models.fusion import silu_mul
from laguna_dflash.server.args import merge_draft_quantization


def test_quantize_rows_rounds_each_row_to_its_own_scale() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # rows of any size
    w[5] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64,)
    assert scale[5] == 1.0 and torch.equal(q[5].float(), torch.zeros(96))
    # each row's largest magnitude lands on e4m3's largest value
    rows = [i for i in range(64) if i != 5]
    assert torch.equal(q[rows].float().abs().amax(1), torch.full((63,), FP8_MAX))
    # e4m3 keeps 3 mantissa bits: a normal value within 2^-4 relative, a subnormal (< 2^-6 of
    # the scale) within 2^-10 of the scale
    back = dequantize_rows(q, scale, torch.float32)
    bound = torch.maximum(w.abs() * 2.0**-4, scale[:, None] * 2.0**-10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert (back - w).abs().max() > 0  # it does round


def test_fp8_linear_on_the_cpu_is_the_dequantized_product() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 32, generator=g), torch.randn(24, 32, generator=g)
    q, scale = quantize_rows(w)
    ref = F.linear(x, dequantize_rows(q, scale, torch.float32))
    assert torch.equal(fp8_linear(x, q, scale), ref)
    assert torch.equal(fp8_linear(x, q, scale, glu=True), silu_mul(ref))
    # layers.linear / gate_up_silu route a scaled weight there (with or without the epilogue)
    assert torch.equal(layers.linear(x, q, scale=scale), ref)
    assert torch.equal(layers.gate_up_silu(x, q, scale=scale), silu_mul(ref))
    linear = torch.nn.Linear(32, 24, bias=False)
    linear.weight.data.copy_(w)
    fp8 = Fp8Linear(linear)
    assert torch.equal(fp8(x), ref) and fp8.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="bias"):
        Fp8Linear(torch.nn.Linear(32, 24))
    # the kernel's own reference agrees with the dequantized product to fp32 rounding
    torch.testing.assert_close(skinny_gemm.skinny_gemm_reference(x, q, scale), ref, rtol=1e-6, atol=1e-6)


def test_bad_values_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--draft-quantization"):
        SpeculativeConfig(draft="d", draft_quantization="int4")
    target, _ = demo_pair()
    with pytest.raises(ValueError, match="draft_quantization was given without draft="):
        LLM(target, draft_quantization="fp8")


@pytest.fixture(scope="module")
def demo_runs():
    """The demo pair, greedy, K = 7: target-only, the drafter in the engine's dtype, in fp8."""
    target, draft = demo_pair()
    prompts = heldout_prompts()[:6]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    runs = {"target": LLM(target).generate(prompts, params)}
    for name, quantization in (("plain", None), ("fp8", "fp8")):
        llm = LLM(target, draft, num_speculative_tokens=7, draft_quantization=quantization)
        runs[name] = (llm, llm.generate(prompts, params), llm.get_metrics())
    return runs


def test_the_engine_quantizes_the_drafter_streamed_weights(demo_runs) -> None:
    plain, fp8 = demo_runs["plain"][0].engine.drafter, demo_runs["fp8"][0].engine.drafter
    assert plain.lm_head_fp8 is None
    for layer, ref in zip(fp8.layers, plain.layers):
        module, before = layer.mlp.gate_up_proj, ref.mlp.gate_up_proj
        assert isinstance(module, Fp8Linear) and module.weight.shape == before.weight.shape
        torch.testing.assert_close(dequantize_rows(module.weight, module.weight_scale, torch.float32),
                                   before.weight, rtol=2.0**-4, atol=module.weight_scale.max().item() * 2.0**-10)
        # the head GEMM's, o_proj and down (no faster in fp8 at N 2048 x K 8192) stay
        for kept in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert kept.weight.dtype == torch.float32
    head_q, head_scale = fp8.lm_head_fp8
    assert head_q.shape == fp8.lm_head_weight.shape and fp8.lm_head_weight.dtype == torch.float32  # the target's own


def test_greedy_output_is_the_target_s_and_acceptance_stays_close(demo_runs) -> None:
    expected = [o.token_ids for o in demo_runs["target"]]
    for name in ("plain", "fp8"):
        assert [o.token_ids for o in demo_runs[name][1]] == expected, name
    plain, fp8 = demo_runs["plain"][2], demo_runs["fp8"][2]
    # the drafts may change (another rounding of the weights), but little: within 5% of the
    # unquantized drafter's acceptance length here (docs/PERFORMANCE.md, sixty-ninth pass: the
    # 32 held-out prompts)
    assert fp8["num_drafts"] > 0
    assert abs(fp8["mean_acceptance_length"] - plain["mean_acceptance_length"]) <= 0.05 * plain["mean_acceptance_length"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_output_is_the_target_s_with_graphs() -> None:
    """On the GPU the drafter's fp8 layers run the skinny GEMM's fp8 path inside the drafter
    block's graph and its lm_head copy eagerly: the greedy output is still the target's (float32,
    where every batch shape gives the target's tokens; CUDA graphs), and the drafts are good ones."""
    target, draft = demo_pair()
    prompts = heldout_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    common = dict(dtype="float32", device="cuda", max_num_seqs=4)
    expected = [o.token_ids for o in LLM(target, **common).generate(prompts, params)]
    llm = LLM(target, draft, num_speculative_tokens=7, draft_quantization="fp8", **common)
    assert isinstance(llm.engine.drafter.layers[0].mlp.gate_up_proj, Fp8Linear)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert llm.get_metrics()["mean_acceptance_length"] > 1.5


# ---- the three spellings --------------------------------------------------------------------------


def _args(**given) -> argparse.Namespace:
    fields = dict(draft_quantization=None, speculative_draft_model_quantization=None, speculative_config=None)
    return argparse.Namespace(**{**fields, **given})


def test_ours_sglangs_and_vllms_spellings_merge() -> None:
    vllm = json.dumps({"method": "dflash", "model": "d", "quantization": "fp8"})
    assert merge_draft_quantization(_args()) is None
    assert merge_draft_quantization(_args(draft_quantization="fp8")) == "fp8"
    assert merge_draft_quantization(_args(speculative_draft_model_quantization="fp8")) == "fp8"
    assert merge_draft_quantization(_args(speculative_draft_model_quantization="unquant")) is None
    assert merge_draft_quantization(_args(speculative_config=vllm, draft_quantization="fp8")) == "fp8"
    assert merge_draft_quantization(_args(speculative_config=json.dumps({"model": "d"}))) is None
    with pytest.raises(ValueError, match="--draft-quantization gives 'fp8' but --speculative-draft-model-quantization"):
        merge_draft_quantization(_args(draft_quantization="fp8", speculative_draft_model_quantization="unquant"))
    with pytest.raises(ValueError, match="--speculative-draft-model-quantization awq is not supported"):
        merge_draft_quantization(_args(speculative_draft_model_quantization="awq"))
    with pytest.raises(ValueError, match="--speculative-config quantization 'gptq' is not supported"):
        merge_draft_quantization(_args(speculative_config=json.dumps({"model": "d", "quantization": "gptq"})))


def test_llm_takes_vllms_key_and_refuses_it_twice() -> None:
    target, draft = demo_pair()
    spec = {"method": "dflash", "model": draft, "quantization": "fp8"}
    llm = LLM(target, speculative_config=spec)
    assert llm.engine.drafter.lm_head_fp8 is not None
    with pytest.raises(ValueError, match="quantization once"):
        LLM(target, speculative_config=spec, draft_quantization="fp8")


def test_cli_flag_needs_a_drafter_and_reaches_the_engine(capsys) -> None:
    from laguna_dflash.cli import main

    target, draft = demo_pair()
    assert main(["generate", "--model", target, "--prompt-ids", "5,6", "--draft-quantization", "fp8"]) != 0
    assert "error: --draft-quantization needs --draft DIR" in capsys.readouterr().err
    code = main(["generate", "--model", target, "--draft", draft, "--prompt-ids", "5,6,7", "--json",
                 "--max-new-tokens", "8", "--speculative-draft-model-quantization", "fp8", "--no-compare"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["token_ids"]) == 8


def test_fp8_linear_keeps_its_unquantized_weight_for_cuda_only() -> None:
    """Fp8Linear keeps the layer's weight (not in its state dict) and hands it to fp8_linear;
    on the CPU every row count still multiplies the dequantized fp8 values (what the acceptance
    benchmark measures), 40 rows included."""
    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(32, 24, bias=False)
    linear.weight.data.copy_(torch.randn(24, 32, generator=g))
    fp8 = Fp8Linear(linear)
    assert torch.equal(fp8.weight_unquantized, linear.weight) and "weight_unquantized" not in fp8.state_dict()
    x = torch.randn(40, 32, generator=g)
    dequantized = F.linear(x, dequantize_rows(fp8.weight, fp8.weight_scale, torch.float32))
    assert torch.equal(fp8(x), dequantized) and not torch.equal(dequantized, F.linear(x, linear.weight))
    assert torch.equal(fp8_linear(x, fp8.weight, fp8.weight_scale, unquantized=linear.weight), dequantized)


def test_the_mlp_and_the_drafter_lm_head_pass_their_unquantized_weights(monkeypatch) -> None:
    """MLP.forward and DFlashDraftModel.lm_head_logits hand fp8_linear the weight before
    quantization (the gate|up's own, the target's lm_head), for its CUDA launches past 16 rows."""
    from laguna_dflash.models import dflash, fp8

    seen, original_fp8_linear = [], fp8.fp8_linear

    def spy(x, quantized, scale, bias=None, glu=False, unquantized=None):
        seen.append(unquantized)
        return original_fp8_linear(x, quantized, scale, bias, glu=glu, unquantized=unquantized)

    monkeypatch.setattr(layers.fp8, "fp8_linear", spy)
    monkeypatch.setattr(dflash, "fp8_linear", spy)
    mlp = layers.MLP(16, 8)
    original = mlp.gate_up_proj.weight
    mlp.gate_up_proj = Fp8Linear(mlp.gate_up_proj)
    mlp(torch.randn(3, 16))
    assert len(seen) == 1 and seen[0] is not None and torch.equal(seen[0], original)
    target, draft = demo_pair()
    llm = LLM(target, draft, num_speculative_tokens=3, draft_quantization="fp8")
    drafter = llm.engine.drafter
    seen.clear()
    drafter.lm_head_logits(torch.randn(2, drafter.lm_head_weight.shape[1]))
    assert len(seen) == 1 and seen[0] is drafter.lm_head_weight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [3, 40])
def test_cuda_fp8_linear_past_16_rows_runs_the_unquantized_weight(m) -> None:
    """With ``unquantized``: up to 16 rows the fp8 kernel (its values), more rows cuBLAS on the
    unquantized weight, bitwise F.linear (the SwiGLU on top bitwise silu_mul)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(256, 512, generator=g) * 512**-0.5).to("cuda", torch.bfloat16)
    q, scale = quantize_rows(w)
    y = fp8_linear(x, q, scale, unquantized=w)
    if m > skinny_gemm.MAX_M:
        assert torch.equal(y, F.linear(x, w))
        assert torch.equal(fp8_linear(x, q, scale, glu=True, unquantized=w), silu_mul(F.linear(x, w)))
    else:
        assert torch.equal(y, fp8_linear(x, q, scale))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [3, 40, 1100])
def test_cuda_fp8_linear_streams_the_fp8_weight_at_any_row_count(m) -> None:
    """Up to 16 rows one skinny launch, more as 16-row blocks (1100: two launches of at most 1024
    rows), never a dequantized copy; the SwiGLU on top where asked."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to("cuda", torch.bfloat16)
    q, scale = quantize_rows(torch.randn(256, 512, generator=g).cuda() * 512**-0.5)
    ref = (x.float() @ (q.float() * scale[:, None]).T).to(torch.bfloat16)
    y = fp8_linear(x, q, scale)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2.0**-7, atol=1e-3)
    assert torch.equal(fp8_linear(x, q, scale, glu=True), silu_mul(y))  # the epilogue is bitwise silu_mul
