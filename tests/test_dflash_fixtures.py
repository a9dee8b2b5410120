"""Checks of the tiny DFlash fixtures (tests/dflash_fixtures.py) and of the dflash oracle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

try:  # pytest "prepend" import mode puts tests/ on sys.path; a tests package would not
    import dflash_fixtures as dfx
except ImportError:  # pragma: no cover
    from tests import dflash_fixtures as dfx

PROMPTS = [[1, 2, 3, 4, 5], [20, 3, 44, 2, 8, 9, 1]]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


@pytest.fixture(scope="module")
def qwen_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dfx.make_tiny_qwen3_target(tmp_path_factory.mktemp("qwen_target"))


@pytest.fixture(scope="module")
def laguna_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dfx.make_tiny_laguna_target(tmp_path_factory.mktemp("laguna_target"))


@pytest.fixture(scope="module")
def qwen_drafter(tmp_path_factory: pytest.TempPathFactory, qwen_target: Path) -> Path:
    return dfx.make_zlab_drafter(tmp_path_factory.mktemp("qwen_drafter"), qwen_target)


@pytest.fixture(scope="module")
def laguna_drafter(tmp_path_factory: pytest.TempPathFactory, laguna_target: Path) -> Path:
    return dfx.make_zlab_drafter(tmp_path_factory.mktemp("laguna_drafter"), laguna_target)


@pytest.fixture(params=["qwen", "laguna"])
def pair(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """(target_dir, distilled z-lab drafter_dir) for a Qwen3 and a Laguna target."""
    kind = request.param
    return request.getfixturevalue(f"{kind}_target"), request.getfixturevalue(f"{kind}_drafter")


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def test_qwen3_target_checkpoint(qwen_target: Path, tmp_path: Path) -> None:
    cfg = _config(qwen_target)
    assert cfg["model_type"] == "qwen3" and cfg["vocab_size"] == 64 and cfg["dtype"] == "float32"
    tensors = _tensors(qwen_target)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm)) and (norm - 1).abs().max() < 0.6
    gen = dfx.reference_target_greedy(qwen_target, PROMPTS[0], 24)
    assert len(gen) == 24 and len(set(gen)) >= 4
    # deterministic in the seed, different across seeds
    same = _tensors(dfx.make_tiny_qwen3_target(tmp_path / "same"))
    other = _tensors(dfx.make_tiny_qwen3_target(tmp_path / "other", seed=1))
    assert all(torch.equal(same[k], v) for k, v in tensors.items())
    assert not torch.equal(other["lm_head.weight"], tensors["lm_head.weight"])


def test_laguna_target_checkpoint(laguna_target: Path) -> None:
    cfg = _config(laguna_target)
    assert cfg["model_type"] == "laguna" and cfg["vocab_size"] == 64
    assert set(cfg["layer_types"]) == {"full_attention", "sliding_attention"}
    assert cfg["sliding_window"] == 4 and cfg["gating"] == "per-head" and cfg["num_experts"] == 4
    assert cfg["num_attention_heads_per_layer"] == [4, 8, 8, 4]
    tensors = _tensors(laguna_target)
    bias = tensors["model.layers.1.mlp.experts.e_score_correction_bias"]
    assert bias.shape == (4,) and bias.abs().min() > 0
    assert tensors["model.layers.1.self_attn.g_proj.weight"].shape == (8, 32)
    # transformers maps the on-disk score bias back onto the router
    model = dfx.load_reference_target(laguna_target)
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    for prompt in PROMPTS:
        gen = dfx.reference_target_greedy(laguna_target, prompt, 24)
        assert len(set(gen)) >= 4


def test_laguna_hidden_states_are_decoder_layer_outputs(laguna_target: Path) -> None:
    """``hidden_states[t + 1]`` = output of layer ``t``; the last entry is post-final-norm."""
    model = dfx.load_reference_target(laguna_target)
    outputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(
            lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out)
        )
        for layer in model.model.layers
    ]
    try:
        ids = torch.tensor([PROMPTS[1]])
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    num_layers = model.config.num_hidden_layers
    assert len(out.hidden_states) == num_layers + 1
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(ids))
    for t in range(num_layers - 1):
        assert torch.equal(out.hidden_states[t + 1], outputs[t])
    assert torch.allclose(out.hidden_states[num_layers], model.model.norm(outputs[-1]))
    assert not torch.allclose(out.hidden_states[num_layers], outputs[-1])


# ---------------------------------------------------------------------------------------------
# Drafter formats
# ---------------------------------------------------------------------------------------------


def test_zlab_drafter_on_disk_format(qwen_drafter: Path) -> None:
    cfg = _config(qwen_drafter)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_target_layers"] == 4
    assert cfg["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": 63,
        "target_layer_ids": [1, 2],
    }
    tensors = _tensors(qwen_drafter)
    h, hd, nh, nkv, inter = 32, 8, 4, 2, 64
    expected = {
        "fc.weight": (h, 2 * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "layers.0.input_layernorm.weight": (h,),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (nh * hd, h),
        "layers.0.self_attn.k_proj.weight": (nkv * hd, h),
        "layers.0.self_attn.v_proj.weight": (nkv * hd, h),
        "layers.0.self_attn.o_proj.weight": (h, nh * hd),
        "layers.0.self_attn.q_norm.weight": (hd,),
        "layers.0.self_attn.k_norm.weight": (hd,),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == torch.float32 for v in tensors.values())
    draft = dfx.load_reference_drafter(qwen_drafter)
    assert (draft.block_size, draft.mask_token_id, draft.target_layer_ids) == (4, 63, [1, 2])


def test_zlab_drafter_options(qwen_target: Path, tmp_path: Path) -> None:
    d = dfx.make_zlab_drafter(
        tmp_path / "d",
        qwen_target,
        num_layers=2,
        block_size=3,
        mask_token_id=0,
        target_layer_ids=[0, 1, 2],
        distill_steps=0,
        block_size_top_level=True,
    )
    cfg = _config(d)
    assert cfg["block_size"] == 3 and "block_size" not in cfg["dflash_config"]
    draft = dfx.load_reference_drafter(d)
    assert (draft.block_size, draft.mask_token_id, draft.target_layer_ids) == (3, 0, [0, 1, 2])
    assert _tensors(d)["fc.weight"].shape == (32, 96) and len(draft.layers) == 2
    with pytest.raises(ValueError, match="mask_token_id"):
        dfx.make_zlab_drafter(tmp_path / "bad", qwen_target, mask_token_id=64, distill_steps=0)


def test_dflash_config_key_lookup() -> None:
    """Documents where DFlashDraftModel reads its keys (see the module docstring)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    base: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    nested = {"block_size": 4, "mask_token_id": 63, "target_layer_ids": [1], "num_target_layers": 4}
    with pytest.raises(AttributeError, match="num_target_layers"):
        DFlashDraftModel(Qwen3Config(**base, dflash_config=nested))
    # dflash_config.causal is ignored; causality comes from layer_types or top-level is_causal
    model = DFlashDraftModel(
        Qwen3Config(
            **base,
            num_target_layers=4,
            dflash_config={**nested, "causal": True},
            layer_types=["full_attention", "sliding_attention"],
            use_sliding_window=True,
            sliding_window=5,
        )
    )
    attn = [layer.self_attn for layer in model.layers]
    assert [(a.is_causal, a.sliding_window) for a in attn] == [(False, None), (True, 5)]
    model = DFlashDraftModel(
        Qwen3Config(**base, num_target_layers=4, dflash_config=nested, is_causal=True)
    )
    assert all(layer.self_attn.is_causal for layer in model.layers)
    # dflash_config wins over the top level
    model = DFlashDraftModel(
        Qwen3Config(**base, num_target_layers=4, block_size=7, dflash_config=nested)
    )
    assert model.block_size == 4


def test_poolside_drafter_on_disk_format(laguna_target: Path, tmp_path: Path) -> None:
    d = dfx.make_poolside_laguna_drafter(tmp_path / "p", laguna_target, target_layer_ids=[0, 1, 2])
    cfg = _config(d)
    assert cfg["architectures"] == ["DFlashLagunaForCausalLM"] and cfg["model_type"] == "laguna"
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["num_experts"] == 0
    assert cfg["gating"] == "per-head" and cfg["vocab_size"] == cfg["draft_vocab_size"] == 64
    assert cfg["rope_theta"] == 500000.0 and "rope_parameters" not in cfg
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": 63,
        "num_target_layers": 4,
        "target_layer_ids": [0, 1, 2],
        "causal": True,
    }
    h, hd, nh, nkv, inter = 32, 8, 4, 2, 64
    expected = {
        "fc.weight": (h, 3 * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        **{f"aux_hidden_norms.{j}.weight": (h,) for j in range(3)},
    }
    for i in range(2):
        p = f"layers.{i}."
        expected.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, h),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "self_attn.g_proj.weight": (nh, h),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    tensors = _tensors(d)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == torch.float32 for v in tensors.values())
    norms = [v for k, v in tensors.items() if "norm" in k]
    assert all(
        not torch.allclose(v, torch.ones_like(v)) and (v - 1).abs().max() < 0.6 for v in norms
    )

    bf16 = dfx.make_poolside_laguna_drafter(
        tmp_path / "b",
        laguna_target,
        num_layers=1,
        block_size=8,
        mask_token_id=12,
        dtype=torch.bfloat16,
    )
    cfg = _config(bf16)
    assert cfg["torch_dtype"] == "bfloat16" and cfg["dflash_config"]["mask_token_id"] == 12
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2] and cfg["layer_types"] == [
        "sliding_attention"
    ]
    tensors = _tensors(bf16)
    assert all(v.dtype == torch.bfloat16 for v in tensors.values()) and len(tensors) == 5 + 10


# ---------------------------------------------------------------------------------------------
# The reference loop
# ---------------------------------------------------------------------------------------------


def test_reference_is_lossless_and_accepts(pair: tuple[Path, Path]) -> None:
    target, drafter = pair
    all_taus: list[int] = []
    for prompt in PROMPTS:
        expected = dfx.reference_target_greedy(target, prompt, 32)
        generated, taus = dfx.reference_dflash_generate(target, drafter, prompt, 32)
        assert generated == expected
        assert sum(taus) == len(generated) - 1 and all(1 <= t <= 4 for t in taus)
        all_taus += taus
    assert max(all_taus) > 1 and sum(all_taus) / len(all_taus) > 1.3


def test_reference_taus_equal_verify_pass_acceptance(
    laguna_target: Path, laguna_drafter: Path
) -> None:
    """Cross-check dflash's ``acceptance_lengths`` against ``a + 1`` recomputed from each verify."""
    from dflash.model import dflash_generate

    target = dfx.load_reference_target(laguna_target)
    draft = dfx.load_reference_drafter(laguna_drafter)
    recomputed: list[int] = []

    def hook(
        _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        ids = args[0]
        if "logits_to_keep" in kwargs:  # the prefill call
            return
        target_choice = out.logits[0].argmax(-1)
        match = (ids[0, 1:] == target_choice[:-1]).to(torch.int64).cumprod(0)
        recomputed.append(int(match.sum()) + 1)

    handle = target.register_forward_hook(hook, with_kwargs=True)
    try:
        with dfx._cpu_safe_dflash_timing():
            stats = dflash_generate(
                draft, target, torch.tensor([PROMPTS[0]]), 30, None, return_stats=True
            )
    finally:
        handle.remove()
    taus = list(stats.acceptance_lengths)
    assert taus[:-1] == recomputed[:-1] and 1 <= taus[-1] <= recomputed[-1]
    generated, ref_taus = dfx.reference_dflash_generate(
        laguna_target, laguna_drafter, PROMPTS[0], 30
    )
    assert ref_taus == taus and generated == stats.output_ids[0, len(PROMPTS[0]) :].tolist()


def test_reference_lossless_with_random_sliding_drafter(tmp_path: Path) -> None:
    """Sliding layer 0 in the target, a random 2-layer drafter with causal+windowed layers."""
    target = dfx.make_tiny_laguna_target(
        tmp_path / "t",
        seed=3,
        sliding_window=3,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
    )
    drafter = dfx.make_zlab_drafter(
        tmp_path / "d",
        target,
        seed=3,
        num_layers=2,
        block_size=5,
        distill_steps=0,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=4,
    )
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    expected = dfx.reference_target_greedy(target, prompt, 24)
    generated, taus = dfx.reference_dflash_generate(target, drafter, prompt, 24)
    assert generated == expected and sum(taus) == 23
    generated, taus = dfx.reference_dflash_generate(target, drafter, prompt, 24, block_size=2)
    assert generated == expected and set(taus) <= {1, 2}


def test_reference_stop_token(qwen_target: Path, qwen_drafter: Path) -> None:
    expected = dfx.reference_target_greedy(qwen_target, PROMPTS[0], 32)
    stop = expected[10]
    cut = expected.index(stop) + 1
    generated, taus = dfx.reference_dflash_generate(
        qwen_target, qwen_drafter, PROMPTS[0], 32, stop_token_ids=[stop]
    )
    assert generated == expected[:cut] and sum(taus) == cut - 1


def test_reference_sampling_is_seeded(laguna_target: Path, laguna_drafter: Path) -> None:
    rng_before = torch.random.get_rng_state()
    runs = [
        dfx.reference_dflash_generate(laguna_target, laguna_drafter, PROMPTS[1], 20, 1.0, seed=s)
        for s in (7, 7, 8)
    ]
    assert torch.equal(rng_before, torch.random.get_rng_state())
    assert runs[0] == runs[1]
    for generated, taus in runs:
        assert len(generated) == 20 and all(0 <= t < 64 for t in generated)
        assert sum(taus) == 19 and all(1 <= t <= 4 for t in taus)
