"""Poolside Laguna target (``LagunaForCausalLM``): config resolution onto the shared decoder.

Every config form a released checkpoint uses resolves here (reference/laguna.md sections 1-3):
nested ``rope_parameters`` by layer type or the flat form with ``swa_rope_parameters``; MLP layer
kinds from ``mlp_layer_types`` or ``mlp_only_layers`` / ``decoder_sparse_step``; gating from
``gating`` / ``gating_types`` and, when ambiguous, from the ``g_proj`` weight shape.
"""

from __future__ import annotations

from ..distributed import SINGLE, TensorParallel
from .config_utils import ConfigReader, eos_ids
from .decoder import DecoderLM, LayerSpec, ModelSpec, MoESpec
from .rope import RopeSpec

# transformers' LagunaConfig defaults, used when config.json has no RoPE settings at all.
_DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


# transformers' LagunaConfig defaults of fields this reader does not require. Generic defaults
# (head_dim = hidden / heads, kv heads = heads, no experts, no shared expert) would build another
# model than transformers from the same config.json (2048 / 48 is not even a head size).
_DEFAULT_HEAD_DIM = 128
_DEFAULT_KV_HEADS = 8
_DEFAULT_NUM_EXPERTS = 256
_DEFAULT_SHARED_EXPERT_SIZE = 512


def resolve_layer_rope(cfg: dict, layer_type: str) -> dict:
    """RoPE dict of one layer type, in vLLM's resolution order.

    1. nested ``rope_parameters[layer_type]`` (falling back to ``full_attention``; scalars beside
       the per-type dicts, e.g. ``original_max_position_embeddings``, fill what a scaled one
       lacks), else the flat dict (``rope_parameters`` or legacy ``rope_scaling``);
    2. on sliding layers ``swa_rope_parameters`` wins;
    3. a top-level ``partial_rotary_factor`` / ``rope_theta`` fill only what the dict lacks.
    """
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not rope and "rope_theta" not in cfg:
        rope = _DEFAULT_ROPE
    rope = dict(rope or {})
    if any(isinstance(v, dict) for v in rope.values()):
        chosen = rope.get(layer_type) or rope.get("full_attention")
        if chosen is None:
            raise ValueError(
                f"config.json rope_parameters has no entry for {layer_type!r} nor 'full_attention'"
            )
        chosen = dict(chosen)
        # Scaling settings beside the per-type dicts (lablup's "XS.2 style" puts
        # original_max_position_embeddings there) fill only what a scaled (non-default) dict
        # lacks, as the top-level config fields below do; dropping them would silently make
        # the YaRN base max_position_embeddings (transformers crashes on this form).
        if chosen.get("rope_type", chosen.get("type", "default")) not in (None, "default"):
            for key, value in rope.items():
                if key not in ("rope_type", "type") and not isinstance(value, dict) and value is not None:
                    chosen.setdefault(key, value)
    else:
        chosen = rope
    if layer_type == "sliding_attention" and cfg.get("swa_rope_parameters"):
        chosen = dict(cfg["swa_rope_parameters"])
    if "partial_rotary_factor" not in chosen and cfg.get("partial_rotary_factor") is not None:
        chosen["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if "rope_theta" not in chosen and cfg.get("rope_theta") is not None:
        chosen["rope_theta"] = cfg["rope_theta"]
    return chosen


def resolve_moe_layers(cfg: dict, num_layers: int) -> list[bool]:
    """Which layers are MoE: ``mlp_layer_types`` (HF v5) or ``mlp_only_layers``/``decoder_sparse_step``."""
    r = ConfigReader(cfg, "LagunaForCausalLM")
    num_experts = r.int("num_experts", _DEFAULT_NUM_EXPERTS)
    legacy = None
    if "mlp_only_layers" in cfg or "decoder_sparse_step" in cfg:
        dense = set(cfg.get("mlp_only_layers") or [])
        step = r.positive_int("decoder_sparse_step", 1)
        legacy = [i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    if cfg.get("mlp_layer_types") is not None:
        kinds = cfg["mlp_layer_types"]
        if (not isinstance(kinds, list) or len(kinds) != num_layers
                or any(k not in ("dense", "sparse") for k in kinds)):
            raise ValueError(
                "config.json mlp_layer_types must list 'dense' or 'sparse' for each of the "
                f"{num_layers} layers, got {kinds}"
            )
        is_moe = [k == "sparse" and num_experts > 0 for k in kinds]
        if legacy is not None and legacy != is_moe:
            # transformers reads the first form, vLLM the second: they would build different models
            raise ValueError(
                f"config.json mlp_layer_types {kinds} and mlp_only_layers "
                f"{cfg.get('mlp_only_layers')} / decoder_sparse_step {cfg.get('decoder_sparse_step', 1)} "
                "name different MoE layers (transformers reads the first, vLLM the second); fix "
                "one of them or remove mlp_only_layers and decoder_sparse_step"
            )
        return is_moe
    if legacy is not None:
        return legacy
    return [i > 0 and num_experts > 0 for i in range(num_layers)]


def resolve_gating(cfg: dict, layer: int, num_heads: int, head_dim: int, g_rows: int | None) -> str | None:
    """``None`` / ``"per-head"`` / ``"per-element"`` for one layer.

    ``gating: true`` is ambiguous across implementations (per-head in transformers and vLLM,
    per-element in Poolside's remote code), so the ``g_proj`` row count decides when known.
    """
    types = cfg.get("gating_types")  # one per layer: both callers checked its length
    gating = types[layer] if types else cfg.get("gating", True)
    if gating is False or gating is None or gating in ("none", "disabled"):
        return None
    if isinstance(gating, str):
        g = gating.replace("_", "-")
        if g not in ("per-head", "per-element"):
            raise ValueError(
                f"config.json gating={gating!r} is not understood; use true, false, 'per-head' or "
                "'per-element'"
            )
        return g
    if g_rows == num_heads * head_dim and g_rows != num_heads:
        return "per-element"
    return "per-head"


def laguna_spec(cfg: dict, shapes: dict[str, tuple[int, ...]] | None = None, prefix: str = "model.") -> ModelSpec:
    """Resolve a Laguna ``config.json`` dict (plus on-disk tensor shapes) into a :class:`ModelSpec`."""
    r = ConfigReader(cfg, "LagunaForCausalLM")
    shapes = shapes or {}
    num_layers = r.positive_int("num_hidden_layers")
    hidden = r.positive_int("hidden_size")
    num_heads = r.positive_int("num_attention_heads")
    head_dim = r.positive_int("head_dim", _DEFAULT_HEAD_DIM)
    max_pos = r.positive_int("max_position_embeddings", 131072)
    heads = cfg.get("num_attention_heads_per_layer") or [num_heads] * num_layers
    layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
    r.check_len("num_attention_heads_per_layer", heads, num_layers)
    r.check_len("layer_types", layer_types, num_layers)
    if cfg.get("gating_types"):
        r.check_len("gating_types", cfg["gating_types"], num_layers)
    is_moe = resolve_moe_layers(cfg, num_layers)
    sinks = r.bool("swa_attention_sink_enabled")
    window = r.optional_int("sliding_window")
    layers = []
    for i in range(num_layers):
        lt = layer_types[i]
        if lt not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config.json layer_types[{i}]={lt!r}; use full_attention or sliding_attention")
        is_sliding = lt == "sliding_attention"
        if is_sliding and not window:
            raise ValueError("config.json has sliding_attention layers but no sliding_window; set it")
        g_shape = shapes.get(f"{prefix}layers.{i}.self_attn.g_proj.weight")
        layers.append(LayerSpec(
            num_heads=heads[i],
            rope=RopeSpec.from_dict(resolve_layer_rope(cfg, lt), head_dim, max_pos),
            sliding_window=int(window) if is_sliding else None,
            gating=resolve_gating(cfg, i, heads[i], head_dim, g_shape[0] if g_shape else None),
            has_sinks=sinks and is_sliding,
            is_moe=is_moe[i],
        ))
    moe = None
    if any(is_moe):
        if cfg.get("moe_router_use_sigmoid") is False:
            # the legacy key some ports read as softmax routing; ignoring it would route by sigmoid
            raise ValueError(
                "config.json has moe_router_use_sigmoid=false (softmax router scores), which is not "
                "supported; Laguna routes by sigmoid: remove the field or set it to true, or set "
                "moe_router_score_func to 'sigmoid' or 'sqrtsoftplus'"
            )
        moe = MoESpec(
            num_experts=r.int("num_experts", _DEFAULT_NUM_EXPERTS),
            top_k=r.int("num_experts_per_tok"),
            moe_intermediate_size=r.int("moe_intermediate_size"),
            shared_intermediate_size=r.int("shared_expert_intermediate_size", _DEFAULT_SHARED_EXPERT_SIZE),
            routed_scaling_factor=r.float("moe_routed_scaling_factor", 1.0),
            logit_softcapping=r.float("moe_router_logit_softcapping", 0.0),
            score_func=cfg.get("moe_router_score_func", "sigmoid"),
            norm_topk_prob=r.bool("norm_topk_prob", True),
        )
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"config.json field 'num_experts_per_tok' must be in [1, num_experts="
                             f"{moe.num_experts}], got {moe.top_k}")
        if r.bool("moe_apply_router_weight_on_input"):
            raise ValueError("moe_apply_router_weight_on_input=true is not supported (no release uses it)")
    return ModelSpec(
        vocab_size=r.positive_int("vocab_size"),
        hidden_size=hidden,
        num_kv_heads=r.positive_int("num_key_value_heads", _DEFAULT_KV_HEADS),
        head_dim=head_dim,
        intermediate_size=r.positive_int("intermediate_size"),
        layers=tuple(layers),
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        qkv_bias=r.bool("qkv_bias", r.bool("attention_bias")),
        o_bias=r.bool("attention_bias"),
        tie_word_embeddings=r.bool("tie_word_embeddings"),
        max_position_embeddings=max_pos,
        moe=moe,
        eos_token_ids=eos_ids(cfg),
    )


class LagunaForCausalLM(DecoderLM):
    """Laguna MoE target with aux hidden-state taps."""

    @classmethod
    def from_config(cls, cfg: dict, shapes: dict | None = None,
                    tp: TensorParallel = SINGLE) -> LagunaForCausalLM:
        return cls(laguna_spec(cfg, shapes), tp)
