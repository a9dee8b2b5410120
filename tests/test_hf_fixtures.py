"""Checks that the fixtures in ``tests/hf_fixtures.py`` do what they claim.

These tests exercise only transformers and the fixture helpers, not ``laguna_dflash``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import hf_fixtures as hf
import pytest
import torch

# 30 ordinary (non-special) token ids: longer than every sliding window used (6-8).
PROMPT = [(7 * i + 11) % 370 + 10 for i in range(30)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def laguna_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build every named Laguna config once (seed 0) into its own directory."""
    root = tmp_path_factory.mktemp("laguna")
    return {
        name: hf.make_laguna_checkpoint(root / name, name, seed=0) for name in hf.LAGUNA_CONFIGS
    }


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build every named Qwen3 variant once (seed 0)."""
    root = tmp_path_factory.mktemp("qwen3")
    return {v: hf.make_qwen3_checkpoint(root / v, seed=0, variant=v) for v in hf.QWEN3_CONFIGS}


def _copy(src: Path, dst: Path) -> Path:
    """Copy a checkpoint directory so a test can rewrite it in place."""
    shutil.copytree(src, dst)
    return dst


def _config(directory: Path) -> dict[str, Any]:
    """Read ``config.json``."""
    return json.loads((directory / "config.json").read_text())


# ------------------------------------------------------------------------------------------
# Configs and checkpoints
# ------------------------------------------------------------------------------------------


def test_configs_cover_required_features() -> None:
    """The named configs together cover every feature the loader must handle."""
    cfgs = hf.LAGUNA_CONFIGS
    assert len(cfgs) >= 6
    vals = list(cfgs.values())

    def heads(c: dict[str, Any]) -> list[int]:
        return (
            c.get("num_attention_heads_per_layer")
            or [c["num_attention_heads"]] * c["num_hidden_layers"]
        )

    for c in vals:
        assert c["hidden_size"] <= 64 and 8 <= c["head_dim"] <= 16 and c["num_hidden_layers"] <= 4
        assert all(h % c["num_key_value_heads"] == 0 for h in heads(c))
        assert 6 <= c["num_experts"] <= 8 and 2 <= c["num_experts_per_tok"] <= 3
        assert c["shared_expert_intermediate_size"] > 0
        assert c["sliding_window"] < len(PROMPT)
    assert any({"full_attention", "sliding_attention"} <= set(c["layer_types"]) for c in vals)
    assert any(set(c["layer_types"]) == {"sliding_attention"} for c in vals)
    assert any(set(c["layer_types"]) == {"full_attention"} for c in vals)
    assert any(len(set(heads(c))) > 1 for c in vals)
    assert {c["gating"] for c in vals} >= {True, "per-head", "per-element"}
    yarn = [
        c["rope_parameters"]["full_attention"]
        for c in vals
        if c["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    ]
    assert any("attention_factor" in y for y in yarn) and any(
        "attention_factor" not in y for y in yarn
    )
    assert all(
        y["partial_rotary_factor"] == 0.5 and y["beta_fast"] and y["beta_slow"] for y in yarn
    )
    assert all(c["rope_parameters"]["sliding_attention"]["rope_type"] == "default" for c in vals)
    assert any(
        all(r["rope_type"] == "default" for r in c["rope_parameters"].values()) for c in vals
    )
    assert any("dense" in c["mlp_layer_types"][1:] for c in vals)
    assert any("dense" not in c["mlp_layer_types"] for c in vals)
    assert any(c.get("moe_routed_scaling_factor", 1.0) != 1.0 for c in vals)
    assert any(c.get("moe_router_logit_softcapping", 0.0) > 0 for c in vals)
    assert any(c.get("tie_word_embeddings") for c in vals)
    assert any(c.get("moe_router_score_func") == "sqrtsoftplus" for c in vals)
    assert any(c.get("swa_attention_sink_enabled") for c in vals)


@pytest.mark.parametrize("name", sorted(hf.LAGUNA_CONFIGS))
def test_laguna_checkpoint_layout(laguna_dirs: dict[str, Path], name: str) -> None:
    """Each config saves with the documented on-disk names, shapes and non-trivial values."""
    directory = laguna_dirs[name]
    spec = hf.LAGUNA_CONFIGS[name]
    config = _config(directory)
    assert config["architectures"] == ["LagunaForCausalLM"] and config["model_type"] == "laguna"
    assert (directory / "model.safetensors").exists()
    tensors = hf.load_checkpoint_tensors(directory)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    hidden, hd, nkv, experts = (
        spec["hidden_size"],
        spec["head_dim"],
        spec["num_key_value_heads"],
        spec["num_experts"],
    )
    heads = config["num_attention_heads_per_layer"]
    per_head = spec["gating"] in (True, "per-head")
    assert ("lm_head.weight" in tensors) == (not spec.get("tie_word_embeddings", False))
    assert tensors["model.embed_tokens.weight"].shape == (spec["vocab_size"], hidden)
    assert not any(
        "gate_up_proj" in n or "shared_experts." in n or "mlp.gate.e_score" in n for n in tensors
    )
    for layer, kind in enumerate(spec["mlp_layer_types"]):
        p = f"model.layers.{layer}."
        assert tensors[p + "self_attn.q_proj.weight"].shape == (heads[layer] * hd, hidden)
        assert tensors[p + "self_attn.k_proj.weight"].shape == (nkv * hd, hidden)
        assert tensors[p + "self_attn.o_proj.weight"].shape == (hidden, heads[layer] * hd)
        gate_rows = heads[layer] if per_head else heads[layer] * hd
        assert tensors[p + "self_attn.g_proj.weight"].shape == (gate_rows, hidden)
        assert not torch.equal(tensors[p + "self_attn.q_norm.weight"], torch.ones(hd))
        assert not torch.equal(tensors[p + "input_layernorm.weight"], torch.ones(hidden))
        has_sink = (
            spec.get("swa_attention_sink_enabled")
            and spec["layer_types"][layer] == "sliding_attention"
        )
        assert (p + "self_attn.sink" in tensors) == bool(has_sink)
        if kind == "dense":
            assert tensors[p + "mlp.gate_proj.weight"].shape == (spec["intermediate_size"], hidden)
            assert not any(n.startswith(p + "mlp.experts") for n in tensors)
        else:
            inter, shared = spec["moe_intermediate_size"], spec["shared_expert_intermediate_size"]
            assert tensors[p + "mlp.gate.weight"].shape == (experts, hidden)
            bias = tensors[p + "mlp.experts.e_score_correction_bias"]
            assert bias.shape == (experts,) and bias.abs().min() > 0
            for e in range(experts):
                assert tensors[f"{p}mlp.experts.{e}.gate_proj.weight"].shape == (inter, hidden)
                assert tensors[f"{p}mlp.experts.{e}.up_proj.weight"].shape == (inter, hidden)
                assert tensors[f"{p}mlp.experts.{e}.down_proj.weight"].shape == (hidden, inter)
            assert tensors[p + "mlp.shared_expert.gate_proj.weight"].shape == (shared, hidden)
            assert tensors[p + "mlp.shared_expert.down_proj.weight"].shape == (hidden, shared)
    logits = hf.hf_prompt_logits(directory, PROMPT)
    assert logits.shape == (len(PROMPT), spec["vocab_size"]) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.std(-1).min() > 0.5


def test_checkpoints_are_deterministic(tmp_path: Path, laguna_dirs: dict[str, Path]) -> None:
    """Same name and seed give identical tensors; another seed gives different ones."""
    again = hf.load_checkpoint_tensors(hf.make_laguna_checkpoint(tmp_path / "a", "xs_mini", seed=0))
    other = hf.load_checkpoint_tensors(hf.make_laguna_checkpoint(tmp_path / "b", "xs_mini", seed=1))
    base = hf.load_checkpoint_tensors(laguna_dirs["xs_mini"])
    assert all(torch.equal(base[n], again[n]) for n in base)
    assert not torch.equal(
        base["model.layers.1.mlp.gate.weight"], other["model.layers.1.mlp.gate.weight"]
    )


def test_qwen3_variants(qwen3_dirs: dict[str, Path]) -> None:
    """The Qwen3 variants save with the expected tie / sliding settings."""
    assert "lm_head.weight" in hf.load_checkpoint_tensors(qwen3_dirs["base"])
    assert "lm_head.weight" not in hf.load_checkpoint_tensors(qwen3_dirs["tied"])
    sliding = _config(qwen3_dirs["sliding"])
    assert sliding["architectures"] == ["Qwen3ForCausalLM"]
    assert sliding["sliding_window"] == 6 and sliding["use_sliding_window"] is True
    assert sliding["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert _config(qwen3_dirs["base"])["sliding_window"] is None


# ------------------------------------------------------------------------------------------
# Name styles, sharding, config forms
# ------------------------------------------------------------------------------------------


def test_name_rewrite_round_trip(tmp_path: Path, laguna_dirs: dict[str, Path]) -> None:
    """per_expert -> fused -> per_expert restores identical tensors; fused has HF's layout."""
    directory = _copy(laguna_dirs["xs_mini"], tmp_path / "ckpt")
    original = hf.load_checkpoint_tensors(directory)
    spec = hf.LAGUNA_CONFIGS["xs_mini"]
    experts, inter, hidden = spec["num_experts"], spec["moe_intermediate_size"], spec["hidden_size"]

    hf.rewrite_checkpoint_names(directory, "fused")
    fused = hf.load_checkpoint_tensors(directory)
    assert not any(".mlp.experts.0." in n or ".shared_expert." in n for n in fused)
    gate_up = fused["model.layers.2.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (experts, 2 * inter, hidden)
    assert fused["model.layers.2.mlp.experts.down_proj"].shape == (experts, hidden, inter)
    assert torch.equal(
        gate_up[5, :inter], original["model.layers.2.mlp.experts.5.gate_proj.weight"]
    )
    assert torch.equal(gate_up[5, inter:], original["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(
        fused["model.layers.2.mlp.gate.e_score_correction_bias"],
        original["model.layers.2.mlp.experts.e_score_correction_bias"],
    )
    assert "model.layers.3.mlp.shared_experts.up_proj.weight" in fused
    assert "model.layers.0.mlp.gate_proj.weight" in fused  # dense layer untouched

    hf.rewrite_checkpoint_names(directory, "fused")  # idempotent
    assert hf.load_checkpoint_tensors(directory).keys() == fused.keys()
    hf.rewrite_checkpoint_names(directory, "per_expert")
    restored = hf.load_checkpoint_tensors(directory)
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[n], original[n]) for n in original)


def test_fused_style_loads_in_transformers(tmp_path: Path, laguna_dirs: dict[str, Path]) -> None:
    """transformers reads the fused style too and gives the same logits.

    Not bit-exact: fused tensors are used straight from the (unaligned) safetensors mmap
    while per-expert ones are stacked into fresh aligned memory, and CPU matmul kernels round
    differently by alignment (~1 ulp, 7e-7 on the logits here).
    """
    directory = _copy(laguna_dirs["xs_mini"], tmp_path / "ckpt")
    hf.rewrite_checkpoint_names(directory, "fused")
    expected = hf.hf_prompt_logits(laguna_dirs["xs_mini"], PROMPT)
    torch.testing.assert_close(
        hf.hf_prompt_logits(directory, PROMPT), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("interleave", [False, True])
def test_sharding_round_trip(
    tmp_path: Path, laguna_dirs: dict[str, Path], interleave: bool
) -> None:
    """Sharding writes an HF index and round-trips; transformers loads the shards."""
    directory = _copy(laguna_dirs["xs_mini"], tmp_path / "ckpt")
    original = hf.load_checkpoint_tensors(directory)
    shards = hf.shard_checkpoint(directory, 3, interleave=interleave)
    assert [p.name for p in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (directory / "model.safetensors").exists()
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in original.values()
    )
    loaded = hf.load_checkpoint_tensors(directory)
    assert (
        all(torch.equal(loaded[n], original[n]) for n in original)
        and loaded.keys() == original.keys()
    )
    expected = hf.hf_prompt_logits(laguna_dirs["xs_mini"], PROMPT)
    torch.testing.assert_close(
        hf.hf_prompt_logits(directory, PROMPT), expected, rtol=1e-5, atol=1e-5
    )

    hf.rewrite_checkpoint_names(directory, "fused")  # keeps the shard count
    assert (
        len(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    )
    assert len(list(directory.glob("model-*-of-00003.safetensors"))) == 3
    hf.rewrite_checkpoint_names(directory, "per_expert")
    hf.shard_checkpoint(directory, 1)
    assert (directory / "model.safetensors").exists()
    assert not (directory / "model.safetensors.index.json").exists()
    final = hf.load_checkpoint_tensors(directory)
    assert (
        all(torch.equal(final[n], original[n]) for n in original)
        and final.keys() == original.keys()
    )


def test_config_flat_rope(tmp_path: Path, laguna_dirs: dict[str, Path]) -> None:
    """The flat RoPE form moves the per-type dicts to rope_parameters / swa_rope_parameters."""
    directory = _copy(laguna_dirs["xs_mini"], tmp_path / "ckpt")
    nested = _config(directory)["rope_parameters"]
    config = hf.rewrite_config_flat_rope(directory)
    assert config == _config(directory)
    assert config["rope_parameters"] == nested["full_attention"]
    assert config["swa_rope_parameters"] == nested["sliding_attention"]
    assert (
        config["partial_rotary_factor"] == 0.5
        and config["swa_rope_parameters"]["partial_rotary_factor"] == 1.0
    )
    assert config["rope_theta"] == nested["full_attention"]["rope_theta"]
    assert "full_attention" not in config["rope_parameters"]
    with pytest.raises(AssertionError):
        hf.rewrite_config_flat_rope(directory)  # already flat


def test_config_legacy_mlp(tmp_path: Path, laguna_dirs: dict[str, Path]) -> None:
    """The legacy MLP form lists the dense layers in mlp_only_layers with step 1."""
    directory = _copy(laguna_dirs["bool_gate_default_rope"], tmp_path / "ckpt")
    config = hf.rewrite_config_legacy_mlp(directory)
    assert config == _config(directory)
    assert "mlp_layer_types" not in config
    assert config["mlp_only_layers"] == [1] and config["decoder_sparse_step"] == 1
    assert config["norm_topk_prob"] is True
    with pytest.raises(AssertionError):
        hf.rewrite_config_legacy_mlp(directory)  # already legacy
    both = hf.rewrite_config_flat_rope(directory)  # the two rewrites compose
    assert both["mlp_only_layers"] == [1] and "swa_rope_parameters" in both


# ------------------------------------------------------------------------------------------
# Reference runners
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(hf.LAGUNA_CONFIGS))
def test_laguna_greedy_cache_matches_recompute(laguna_dirs: dict[str, Path], name: str) -> None:
    """KV-cached greedy decoding equals full recompute for prompts longer than the window."""
    directory = laguna_dirs[name]
    cached = hf.hf_greedy(directory, PROMPT, NEW_TOKENS)
    assert cached == hf.hf_greedy(directory, PROMPT, NEW_TOKENS, use_cache=False)
    assert len(cached) == NEW_TOKENS and len(set(cached)) > 1
    logits = hf.hf_prompt_logits(directory, PROMPT + cached)
    assert logits[len(PROMPT) - 1 : -1].argmax(-1).tolist() == cached


@pytest.mark.parametrize("variant", sorted(hf.QWEN3_CONFIGS))
def test_qwen3_greedy_cache_matches_recompute(qwen3_dirs: dict[str, Path], variant: str) -> None:
    """Same check for the Qwen3 variants (including the sliding one)."""
    directory = qwen3_dirs[variant]
    cached = hf.hf_greedy(directory, PROMPT, NEW_TOKENS)
    assert cached == hf.hf_greedy(directory, PROMPT, NEW_TOKENS, use_cache=False)


def test_greedy_matches_generate(laguna_dirs: dict[str, Path]) -> None:
    """The hand-written greedy loop agrees with transformers' own ``generate``."""
    directory = laguna_dirs["xs_mini"]
    with hf.hf_reference_model(directory) as model, torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out[0, len(PROMPT) :].tolist() == hf.hf_greedy(directory, PROMPT, NEW_TOKENS)


def test_greedy_stops_at_eos(laguna_dirs: dict[str, Path]) -> None:
    """``eos_token_id`` ends the continuation right after that token."""
    directory = laguna_dirs["xs_mini"]
    full = hf.hf_greedy(directory, PROMPT, NEW_TOKENS)
    assert (
        hf.hf_greedy(directory, PROMPT, NEW_TOKENS, eos_token_id=[full[2]])
        == full[: full.index(full[2]) + 1]
    )


@pytest.mark.parametrize("name", ["xs_mini", "bool_gate_default_rope", "qwen3"])
def test_sliding_window_semantics(
    tmp_path: Path, laguna_dirs: dict[str, Path], qwen3_dirs: dict[str, Path], name: str
) -> None:
    """Window W means W keys including the query: logits change first at position W."""
    src = qwen3_dirs["sliding"] if name == "qwen3" else laguna_dirs[name]
    directory = _copy(src, tmp_path / "ckpt")
    window = _config(directory)["sliding_window"]
    windowed = hf.hf_prompt_logits(directory, PROMPT)
    config = _config(directory)
    config["sliding_window"] = 4096
    (directory / "config.json").write_text(json.dumps(config))
    unbounded = hf.hf_prompt_logits(directory, PROMPT)
    torch.testing.assert_close(windowed[:window], unbounded[:window], rtol=1e-5, atol=1e-5)
    assert (windowed[window] - unbounded[window]).abs().max() > 1e-3


def test_yarn_attention_factor_handling(laguna_dirs: dict[str, Path]) -> None:
    """HF uses an explicit attention_factor as-is, else 0.1*ln(factor)+1, on rotated dims only."""
    with hf.hf_reference_model(laguna_dirs["xs_mini"]) as model:
        rotary = model.model.rotary_emb
        assert rotary.full_attention_attention_scaling == 1.25
        assert rotary.full_attention_inv_freq.numel() == 4  # hd 16 * partial 0.5 / 2
        assert (
            rotary.sliding_attention_inv_freq.numel() == 8
            and rotary.sliding_attention_attention_scaling == 1.0
        )
    with hf.hf_reference_model(laguna_dirs["per_element_tied"]) as model:
        assert math.isclose(
            model.model.rotary_emb.full_attention_attention_scaling, 0.1 * math.log(4.0) + 1
        )


def test_sink_attention_formula() -> None:
    """The sink attention function implements p = exp(s) / (exp(sink) + sum exp(s))."""
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, n, 5, 4, generator=gen) for n in (4, 2, 2))
    module = torch.nn.Module()
    module.fixture_sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, probs = hf._sink_eager_attention(module, query, key, value, None, scaling=0.5)
    keys = key.repeat_interleave(2, dim=1)
    scores = (query @ keys.transpose(-1, -2)) * 0.5
    expected = scores.exp() / (
        module.fixture_sink.view(1, 4, 1, 1).exp() + scores.exp().sum(-1, keepdim=True)
    )
    torch.testing.assert_close(probs, expected)
    torch.testing.assert_close(out, (expected @ value.repeat_interleave(2, dim=1)).transpose(1, 2))
    assert (probs.sum(-1) < 1).all()


def test_sink_reference(tmp_path: Path) -> None:
    """Sinks of -inf reproduce the plain reference; real sinks change it; cache stays exact."""
    inert = hf.make_laguna_sink_checkpoint(tmp_path / "inert", seed=0, sink_value=float("-inf"))
    live = hf.make_laguna_sink_checkpoint(tmp_path / "live", seed=0)
    tensors = hf.load_checkpoint_tensors(live)
    assert tensors["model.layers.1.self_attn.sink"].shape == (6,)
    assert tensors["model.layers.2.self_attn.sink"].shape == (8,)
    assert "model.layers.0.self_attn.sink" not in tensors  # full-attention layer
    assert _config(live)["swa_attention_sink_enabled"] is True

    plain = hf.hf_prompt_logits(inert, PROMPT, sinks=False)
    torch.testing.assert_close(
        hf.hf_prompt_logits(inert, PROMPT, sinks=True), plain, rtol=1e-5, atol=1e-5
    )
    assert hf.hf_greedy(inert, PROMPT, NEW_TOKENS, sinks=True) == hf.hf_greedy(
        inert, PROMPT, NEW_TOKENS, sinks=False
    )

    with_sinks = hf.hf_prompt_logits(live, PROMPT)  # sinks=None follows the config
    torch.testing.assert_close(
        hf.hf_prompt_logits(live, PROMPT, sinks=True), with_sinks, rtol=0, atol=0
    )
    assert (with_sinks - hf.hf_prompt_logits(live, PROMPT, sinks=False)).abs().max() > 1e-2
    cached = hf.hf_greedy(live, PROMPT, NEW_TOKENS)
    assert cached == hf.hf_greedy(live, PROMPT, NEW_TOKENS, use_cache=False)
    assert with_sinks[-1].argmax().item() == cached[0]


def test_sqrtsoftplus_router_patch(tmp_path: Path, laguna_dirs: dict[str, Path]) -> None:
    """The sqrtsoftplus patch follows the formula, changes the output and does not leak."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.laguna.modeling_laguna import LagunaTopKRouter

    directory = laguna_dirs["sqrtsoftplus"]
    with hf.hf_reference_model(directory) as model:
        router = model.model.layers[1].mlp.gate
        assert "forward" in vars(router)  # patched on the instance only
        x = torch.randn(7, router.hidden_dim, generator=torch.Generator().manual_seed(0))
        logits, weights, selected = router(x)
        scores = torch.sqrt(torch.nn.functional.softplus(x @ router.weight.T))
        expected_sel = torch.topk(
            scores + router.e_score_correction_bias, router.top_k, dim=-1
        ).indices
        assert torch.equal(selected, expected_sel)
        picked = scores.gather(-1, expected_sel)
        torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
    assert "forward" not in vars(LagunaTopKRouter(model.config))
    assert not any(k.startswith("fixture_sink") for k in AttentionInterface._global_mapping)
    assert not any(k.startswith("fixture_sink") for k in AttentionMaskInterface._global_mapping)

    patched = hf.hf_prompt_logits(directory, PROMPT)
    sigmoid_dir = _copy(directory, tmp_path / "sigmoid")
    config = _config(sigmoid_dir)
    del config["moe_router_score_func"]
    (sigmoid_dir / "config.json").write_text(json.dumps(config))
    assert (patched - hf.hf_prompt_logits(sigmoid_dir, PROMPT)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def test_tokenizer_loads_through_autotokenizer(
    tmp_path: Path, laguna_dirs: dict[str, Path]
) -> None:
    """The tokenizer has exactly the model's vocab, loads via AutoTokenizer and chats."""
    from transformers import AutoTokenizer, GenerationConfig

    directory = _copy(laguna_dirs["xs_mini"], tmp_path / "ckpt")
    vocab = hf.LAGUNA_CONFIGS["xs_mini"]["vocab_size"]
    eos = hf.make_tokenizer(directory, vocab)
    tok = AutoTokenizer.from_pretrained(str(directory))
    assert len(tok) == vocab and eos == tok.eos_token_id == 2
    assert (tok.bos_token_id, tok.pad_token_id, tok.mask_token_id) == (1, 0, 3)
    text = "def add(a, b):\n    return a + b  # héllo\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and max(ids) < vocab
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|bos|><|system|>Be brief.<|end|><|user|>Hi there<|end|><|assistant|>"
    chat_ids = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert chat_ids[0] == 1 and chat_ids[-1] == tok.convert_tokens_to_ids("<|assistant|>") == 6
    end = tok.convert_tokens_to_ids("<|end|>")
    assert GenerationConfig.from_pretrained(str(directory)).eos_token_id == [eos, end]
    config = _config(directory)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        1,
        [eos, end],
        0,
    )
    assert hf.hf_greedy(directory, chat_ids, 3)  # the model still loads with the updated config


@pytest.mark.parametrize("vocab", [264, 320, 512])
def test_tokenizer_exact_vocab_sizes(tmp_path: Path, vocab: int) -> None:
    """Any vocab >= 264 is hit exactly (reserved specials fill a short merge list)."""
    hf.make_tokenizer(tmp_path, vocab)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(tmp_path))) == vocab
