"""Laguna and DFlash config fields: what each resolves to, against transformers or the reference.

* Target: for a config lacking one field, the resolved model (head counts and sizes, layer
  kinds, windows, gating, MoE settings, RoPE frequencies and magnitude per layer type) equals
  what transformers 5.17's ``LagunaConfig`` builds from the same dict. The fields our reader
  requires (``hidden_size``, ``vocab_size``, ...) stay errors naming them (tests/test_loader.py).
  ``head_dim``, ``num_key_value_heads``, ``num_experts`` and
  ``shared_expert_intermediate_size`` defaulted to other values than transformers' (``hidden /
  heads``, all heads, no experts, no shared expert).
* ``mlp_layer_types`` (read by transformers) and ``mlp_only_layers`` / ``decoder_sparse_step``
  (read by vLLM) naming different MoE layers is an error naming both: it was a silent choice.
* Drafters: the published Laguna-XS-2.1-DFlash config (reference/laguna.md 4.1) and a z-lab
  Qwen3 config (reference/dflash.md 1.1) resolve to the documented values; a Qwen3 drafter's
  ``layer_types`` of the wrong length is named (it was an IndexError, or silently ignored).
"""

from __future__ import annotations

import copy

import hf_fixtures as hf
import pytest
import torch

from laguna_dflash.models.dflash import qwen3_draft_spec
from laguna_dflash.models.laguna import laguna_spec
from laguna_dflash.models.laguna_dflash import laguna_draft_spec
from laguna_dflash.models.rope import rope_inv_freq

_FULL, _SLIDING = "full_attention", "sliding_attention"


def _hf_view(cfg: dict) -> dict:
    """What transformers' LagunaConfig / LagunaRotaryEmbedding make of ``cfg``."""
    from transformers import LagunaConfig
    from transformers.models.laguna.modeling_laguna import LagunaRotaryEmbedding

    c = LagunaConfig(**copy.deepcopy(cfg))
    rotary = LagunaRotaryEmbedding(c)
    rope = {t: (getattr(rotary, f"{t}_inv_freq"), float(getattr(rotary, f"{t}_attention_scaling")))
            for t in set(c.layer_types)}
    moe = any(t == "sparse" for t in c.mlp_layer_types)
    return {
        "head_dim": c.head_dim, "num_kv_heads": c.num_key_value_heads,
        "heads": list(c.num_attention_heads_per_layer),
        "windows": [c.sliding_window if t == _SLIDING else None for t in c.layer_types],
        "gating": ["per-head" if c.gating is True or c.gating == "per-head" else "per-element"]
        * c.num_hidden_layers,
        "is_moe": [t == "sparse" for t in c.mlp_layer_types],
        "moe": (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                c.shared_expert_intermediate_size, c.moe_routed_scaling_factor,
                c.moe_router_logit_softcapping) if moe else None,
        "tie": c.tie_word_embeddings, "eps": c.rms_norm_eps, "bias": c.attention_bias,
        "max_pos": c.max_position_embeddings,
        "rope": [rope[t] for t in c.layer_types],
    }


def _our_view(cfg: dict) -> dict:
    s = laguna_spec(copy.deepcopy(cfg))
    m = s.moe
    return {
        "head_dim": s.head_dim, "num_kv_heads": s.num_kv_heads,
        "heads": [layer.num_heads for layer in s.layers],
        "windows": [layer.sliding_window for layer in s.layers],
        "gating": [layer.gating for layer in s.layers],
        "is_moe": [layer.is_moe for layer in s.layers],
        "moe": (m.num_experts, m.top_k, m.moe_intermediate_size, m.shared_intermediate_size,
                m.routed_scaling_factor, m.logit_softcapping) if m else None,
        "tie": s.tie_word_embeddings, "eps": s.rms_norm_eps, "bias": s.qkv_bias,
        "max_pos": s.max_position_embeddings,
        "rope": [rope_inv_freq(layer.rope) for layer in s.layers],
    }


def _assert_same(ours: dict, ref: dict) -> None:
    for key in ref:
        if key == "rope":
            for i, ((f_ours, m_ours), (f_ref, m_ref)) in enumerate(zip(ours[key], ref[key])):
                assert f_ours.shape == f_ref.shape, f"layer {i} rotary dim"
                torch.testing.assert_close(f_ours, f_ref.float(), msg=f"layer {i} inv_freq")
                assert m_ours == pytest.approx(m_ref, rel=1e-12), f"layer {i} RoPE magnitude"
        else:
            assert ours[key] == ref[key], f"{key}: ours {ours[key]}, transformers {ref[key]}"


_CONFIGS = ["xs_mini", "bool_gate_default_rope", "per_element_tied"]
_DROPPABLE = [
    "head_dim", "num_key_value_heads", "num_experts", "shared_expert_intermediate_size",
    "max_position_embeddings", "moe_routed_scaling_factor", "moe_router_logit_softcapping",
    "gating", "layer_types", "num_attention_heads_per_layer", "mlp_layer_types",
    "rope_parameters", "tie_word_embeddings", "rms_norm_eps", "attention_bias",
]


@pytest.mark.parametrize("name", _CONFIGS)
@pytest.mark.parametrize("field", [None, *_DROPPABLE])
def test_an_absent_field_resolves_as_transformers(name: str, field: str | None):
    cfg = copy.deepcopy(hf.LAGUNA_CONFIGS[name])
    cfg.pop(field, None)
    _assert_same(_our_view(cfg), _hf_view(cfg))


def test_mlp_layer_types_and_mlp_only_layers_disagreeing_is_named():
    """Release configs carry both forms and they agree; when they do not, transformers and vLLM
    build different models, so the config is refused, naming both fields."""
    cfg = copy.deepcopy(hf.LAGUNA_CONFIGS["xs_mini"])  # mlp_layer_types: dense, sparse x3
    cfg.update(mlp_only_layers=[0], decoder_sparse_step=1)
    assert [layer.is_moe for layer in laguna_spec(cfg).layers] == [False, True, True, True]
    cfg["mlp_only_layers"] = [0, 2]
    with pytest.raises(ValueError, match=r"(?s)mlp_layer_types.*mlp_only_layers"):
        laguna_spec(cfg)


# ---- drafters -------------------------------------------------------------------------------

# poolside/Laguna-XS-2.1-DFlash config.json as reference/laguna.md section 4.1 lists it
_XS_21_DFLASH = {
    "architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 5,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
    "max_position_embeddings": 262144, "sliding_window": 512, "layer_types": [_SLIDING] * 5,
    "gating": "per-head", "num_experts": 0, "vocab_size": 100352, "draft_vocab_size": 100352,
    "torch_dtype": "bfloat16", "eagle_aux_hidden_state_layer_ids": [2, 14, 26, 34, 40],
    "dflash_config": {"block_size": 16, "mask_token_id": 12, "num_target_layers": 40,
                      "target_layer_ids": [1, 13, 25, 33, 39], "causal": True},
}


def test_published_laguna_drafter_config_resolves_as_documented():
    s = laguna_draft_spec(copy.deepcopy(_XS_21_DFLASH), None, None)
    assert (s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size) == (
        2048, 64, 8, 128, 8192)
    assert s.target_layer_ids == (1, 13, 25, 33, 39)
    assert (s.block_size, s.mask_token_id) == (16, 12)
    assert all(layer == s.layers[0] for layer in s.layers) and len(s.layers) == 5
    assert (s.layers[0].sliding_window, s.layers[0].is_causal, s.layers[0].gating) == (512, True, "per-head")
    # its own RoPE: theta 5e5, default, all 128 dims (never the target's SWA theta 1e4)
    assert (s.rope.rope_type, s.rope.theta, s.rope.rotary_dim) == ("default", 500000.0, 128)


# a z-lab Qwen3 drafter config with the fields of reference/dflash.md section 1.1
_ZLAB_QWEN3 = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": 5,
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 12288, "num_target_layers": 36, "block_size": 16,
    "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "layer_types": [_SLIDING] * 4 + [_FULL], "sliding_window": 2048,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}


def test_zlab_qwen3_drafter_config_resolves_as_documented():
    s = qwen3_draft_spec(copy.deepcopy(_ZLAB_QWEN3), None)
    assert s.target_layer_ids == (1, 9, 17, 25, 33)
    assert (s.block_size, s.mask_token_id) == (16, 151669)
    assert [(layer.sliding_window, layer.is_causal) for layer in s.layers] == [(2048, True)] * 4 + [(None, False)]
    assert (s.rope.rope_type, s.rope.theta, s.rope.rotary_dim) == ("default", 1e6, 128)
    cfg = copy.deepcopy(_ZLAB_QWEN3)
    del cfg["dflash_config"]["target_layer_ids"]  # z-lab's default taps from num_target_layers
    assert qwen3_draft_spec(cfg, None).target_layer_ids == (1, 9, 17, 25, 33)


@pytest.mark.parametrize("entries", [3, 6])
def test_qwen3_drafter_layer_types_of_the_wrong_length_is_named(entries: int):
    cfg = copy.deepcopy(_ZLAB_QWEN3)
    cfg["layer_types"] = [_SLIDING] * entries
    with pytest.raises(ValueError, match="layer_types"):
        qwen3_draft_spec(cfg, None)


def test_legacy_softmax_router_key_is_named():
    """``moe_router_use_sigmoid: false`` meant softmax scores in some ports (reference 1.6); it
    was ignored (sigmoid routing, another model). ``true`` is sigmoid and loads."""
    cfg = copy.deepcopy(hf.LAGUNA_CONFIGS["xs_mini"])
    cfg["moe_router_use_sigmoid"] = True
    assert laguna_spec(cfg).moe.score_func == "sigmoid"
    cfg["moe_router_use_sigmoid"] = False
    with pytest.raises(ValueError, match="moe_router_use_sigmoid"):
        laguna_spec(cfg)
