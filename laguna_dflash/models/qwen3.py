"""Qwen3 dense target (``Qwen3ForCausalLM``): the family the z-lab DFlash drafters target."""

from __future__ import annotations

from ..distributed import SINGLE, TensorParallel
from .config_utils import ConfigReader, eos_ids
from .decoder import DecoderLM, LayerSpec, ModelSpec
from .rope import RopeSpec


def qwen3_rope(cfg: dict) -> dict:
    """Flat RoPE dict: ``rope_parameters`` (HF v5) or ``rope_theta`` + legacy ``rope_scaling``."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 1000000.0))
    if "partial_rotary_factor" not in rope and cfg.get("partial_rotary_factor") is not None:
        rope["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    return rope


def qwen3_layer_types(cfg: dict, num_layers: int) -> list[str]:
    """``layer_types`` if given, else HF's rule (sliding from ``max_window_layers`` on)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first = cfg.get("max_window_layers", num_layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["full_attention"] * num_layers


def qwen3_spec(cfg: dict, shapes: dict | None = None) -> ModelSpec:
    """Resolve a Qwen3 ``config.json`` dict into a :class:`ModelSpec`."""
    r = ConfigReader(cfg, "Qwen3ForCausalLM")
    num_layers = r.positive_int("num_hidden_layers")
    hidden = r.positive_int("hidden_size")
    num_heads = r.positive_int("num_attention_heads")
    head_dim = r.positive_int("head_dim", hidden // num_heads)
    max_pos = r.positive_int("max_position_embeddings", 40960)
    layer_types = qwen3_layer_types(cfg, num_layers)
    r.check_len("layer_types", layer_types, num_layers)
    rope = RopeSpec.from_dict(qwen3_rope(cfg), head_dim, max_pos)
    # transformers' Qwen3Config drops sliding_window unless use_sliding_window (default false) is
    # set, and then refuses layer_types that name sliding layers: refuse them here too, rather
    # than window layers transformers would not
    window = r.optional_int("sliding_window") if r.bool("use_sliding_window") else None
    if "sliding_attention" in layer_types and window is None:
        raise ValueError(
            "config.json layer_types names sliding_attention layers but the window is off "
            f"(use_sliding_window={cfg.get('use_sliding_window')!r}, sliding_window="
            f"{cfg.get('sliding_window')!r}); set \"use_sliding_window\": true and a sliding_window "
            "to window them, or make those layer_types full_attention"
        )
    layers = tuple(
        LayerSpec(
            num_heads=num_heads, rope=rope,
            sliding_window=int(window) if lt == "sliding_attention" and window else None,
        )
        for lt in layer_types
    )
    bias = r.bool("attention_bias")
    return ModelSpec(
        vocab_size=r.positive_int("vocab_size"),
        hidden_size=hidden,
        num_kv_heads=r.positive_int("num_key_value_heads", num_heads),
        head_dim=head_dim,
        intermediate_size=r.positive_int("intermediate_size"),
        layers=layers,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        qkv_bias=bias,
        o_bias=bias,
        tie_word_embeddings=r.bool("tie_word_embeddings"),
        max_position_embeddings=max_pos,
        eos_token_ids=eos_ids(cfg),
    )


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3 dense target with aux hidden-state taps."""

    @classmethod
    def from_config(cls, cfg: dict, shapes: dict | None = None,
                    tp: TensorParallel = SINGLE) -> Qwen3ForCausalLM:
        return cls(qwen3_spec(cfg, shapes), tp)
