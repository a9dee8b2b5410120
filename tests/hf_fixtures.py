"""Tiny Hugging Face checkpoints and reference runners for the ``laguna_dflash`` tests.

This is a helper module (not collected by pytest).  It builds tiny, randomly
initialised Laguna and Qwen3 checkpoints with ``transformers`` (the test oracle),
rewrites them into the other on-disk forms real checkpoints use, and runs
``transformers`` as a float32 reference, including two Laguna features that
``transformers`` lacks (SWA attention sinks and the ``sqrtsoftplus`` router),
which are patched in here, scoped to one model instance.

What ``save_pretrained`` writes for Laguna (transformers 5.17.0)
-----------------------------------------------------------------
In memory, ``LagunaForCausalLM`` holds fused expert tensors, but ``save_pretrained``
reverses the ``conversion_mapping["laguna"]`` renames and writes the real on-disk
Laguna names: experts one by one, the score bias under ``mlp.experts.`` and a
singular ``shared_expert``.  For a sparse layer with ``E`` experts of width ``I``
(shared expert width ``Is``).  On disk (``save_pretrained``; style ``"per_expert"``)::

    model.layers.1.mlp.experts.3.gate_proj.weight          [I, H]
    model.layers.1.mlp.experts.3.up_proj.weight            [I, H]
    model.layers.1.mlp.experts.3.down_proj.weight          [H, I]
    model.layers.1.mlp.experts.e_score_correction_bias     [E]
    model.layers.1.mlp.gate.weight                         [E, H]   (router)
    model.layers.1.mlp.shared_expert.gate_proj.weight      [Is, H]
    model.layers.1.mlp.shared_expert.up_proj.weight        [Is, H]
    model.layers.1.mlp.shared_expert.down_proj.weight      [H, Is]

In memory (transformers' parameter names; style ``"fused"``)::

    model.layers.1.mlp.experts.gate_up_proj                [E, 2I, H]  rows [:I] gate, [I:] up
    model.layers.1.mlp.experts.down_proj                   [E, H, I]
    model.layers.1.mlp.gate.e_score_correction_bias        [E]
    model.layers.1.mlp.gate.weight                         [E, H]
    model.layers.1.mlp.shared_experts.{gate,up,down}_proj.weight  (plural "experts")

Names that are the same in both styles::

    model.embed_tokens.weight                      [V, H]
    lm_head.weight                                 [V, H]   (NOT written when tie_word_embeddings=True)
    model.norm.weight                              [H]
    model.layers.{l}.input_layernorm.weight        [H]
    model.layers.{l}.post_attention_layernorm.weight [H]
    model.layers.{l}.self_attn.q_proj.weight       [nh_l*hd, H]
    model.layers.{l}.self_attn.k_proj.weight       [nkv*hd, H]
    model.layers.{l}.self_attn.v_proj.weight       [nkv*hd, H]
    model.layers.{l}.self_attn.o_proj.weight       [H, nh_l*hd]
    model.layers.{l}.self_attn.g_proj.weight       [nh_l, H] per-head, [nh_l*hd, H] per-element
    model.layers.{l}.self_attn.q_norm.weight       [hd]
    model.layers.{l}.self_attn.k_norm.weight       [hd]
    model.layers.{l}.mlp.{gate,up}_proj.weight     [I_dense, H]   (dense layers)
    model.layers.{l}.mlp.down_proj.weight          [H, I_dense]   (dense layers)
    model.layers.{l}.self_attn.sink                [nh_l] (only written by make_laguna_sink_checkpoint,
                                                           sliding layers only; transformers ignores it)

All tensors are float32 and the safetensors metadata is ``{"format": "pt"}``.
``transformers`` loads either style (see ``test_fused_style_loads_in_transformers``), but
not bit-identically: fused tensors are used straight from the unaligned safetensors mmap,
per-expert ones are stacked into fresh aligned memory, and CPU matmul kernels round by
alignment (~7e-7 on the logits).  Compare across load paths with a tolerance.

Behaviour of transformers 5.17 worth knowing (checked in ``test_hf_fixtures.py``)
----------------------------------------------------------------------------------
* Sliding window: query ``i`` sees keys ``j`` with ``i - W < j <= i``, i.e. ``W`` keys
  including itself.  ``DynamicCache`` keeps only the last ``W - 1`` keys of a sliding layer.
* RMSNorm: statistics in fp32, the normalised value is cast back to the input dtype and only
  then multiplied by the (plain, not ``1 + w``) weight.
* Gating: ``True``/``"per-head"`` -> ``g_proj`` has ``nh_l`` rows; ``"per-element"`` -> ``nh_l*hd``
  rows, row ``h*hd + d`` gating channel ``d`` of head ``h``.  Both work.  softplus runs in fp32.
* YaRN: an explicit ``attention_factor`` is used as-is to scale cos/sin of the rotated channels
  (no ``0.1*ln(s)+1`` on top); when absent it defaults to ``0.1*ln(factor)+1``.  ``truncate`` is
  read from the TOP level of ``rope_parameters`` (the nested dict), so a per-layer-type
  ``truncate`` is ignored (and a top-level one crashes): truncation is always on for Laguna.
* Experts: transformers' default ``experts_implementation`` is ``"grouped_mm"`` when available;
  the runners here force ``"eager"`` (and ``attn_implementation="eager"``).
* ``LagunaConfig`` accepts unknown keys (``moe_router_score_func``, ``swa_attention_sink_enabled``)
  and writes them to config.json, but the model ignores them silently.
* Threads: on this shared 2-core box, multi-threaded torch next to another busy process was
  ~18x slower on these tiny models; the builders and runners use one thread (``single_thread``).
* Qwen3: ``sliding_window`` is forced to ``None`` unless ``use_sliding_window=True``; with it,
  ``layer_types`` selects which layers slide.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sysconfig
import types
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "CHAT_TEMPLATE",
    "LAGUNA_CONFIGS",
    "QWEN3_CONFIGS",
    "TOKENIZER_SPECIAL_TOKENS",
    "hf_greedy",
    "hf_prompt_logits",
    "hf_reference_model",
    "load_checkpoint_tensors",
    "make_laguna_checkpoint",
    "make_laguna_sink_checkpoint",
    "make_qwen3_checkpoint",
    "make_tokenizer",
    "rewrite_checkpoint_names",
    "rewrite_config_flat_rope",
    "rewrite_config_legacy_mlp",
    "save_checkpoint_tensors",
    "shard_checkpoint",
    "single_thread",
]

# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------

_FULL = "full_attention"
_SLIDING = "sliding_attention"

# Shared sizes.  The three MLP widths differ on purpose so that a loader which swaps the
# dense, routed-expert and shared-expert weights fails on shapes.
_COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 48,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 32,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# YaRN on full layers.  With hd=16 and partial 0.5 the rotary dim is 8 (4 frequencies);
# theta=5e5, L0=512, beta 32/1 give a correction range lo=0, hi=2, i.e. ramp [0, .5, 1, 1]:
# one extrapolated, one blended and two interpolated frequencies.
_YARN_EXPLICIT_FACTOR = {
    "rope_type": "yarn",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 1.25,  # differs from 0.1*ln(8)+1 = 1.2079
    "partial_rotary_factor": 0.5,
}
# Same without attention_factor (HF then uses 0.1*ln(factor)+1 = 1.1386 for factor 4).
_YARN_DEFAULT_FACTOR = {
    "rope_type": "yarn",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "partial_rotary_factor": 0.5,
}
_DEFAULT_SLIDING = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
_DEFAULT_FULL_PARTIAL = {
    "rope_type": "default",
    "rope_theta": 500000.0,
    "partial_rotary_factor": 0.5,
}


def _cfg(**kwargs: Any) -> dict[str, Any]:
    """Return ``_COMMON`` updated with ``kwargs`` (deep-copied, so configs share nothing)."""
    return copy.deepcopy({**_COMMON, **kwargs})


#: Named tiny LagunaConfig kwarg dicts.  Feature coverage (all together):
#:
#: * ``xs_mini``: XS-like.  4 layers [full, swa, swa, swa], window 7, heads [4, 8, 8, 6] (kv 2),
#:   gating "per-head", nested RoPE with YaRN (explicit attention_factor) on full / default on
#:   sliding, dense layer 0 then sparse, scaling 2.5, top-2.
#: * ``bool_gate_default_rope``: gating ``True``, default RoPE on both types (full partial 0.5),
#:   [swa, full, swa] window 6, uniform heads, mlp [sparse, dense, sparse] (dense not at 0),
#:   router softcapping 1.0, top-3, scaling factor left at the default 1.0.
#: * ``per_element_tied``: gating "per-element", ``tie_word_embeddings=True``, [full, swa, full]
#:   window 8, heads [2, 4, 6], YaRN WITHOUT attention_factor, scaling 1.5.
#: * ``all_sliding_sparse``: every layer sliding (window 6) and sparse (no dense layer),
#:   heads [2, 6], softcapping 2.0, scaling 2.5.
#: * ``full_only``: every layer full attention (sliding_window unused), mlp [dense, sparse, dense].
#: * ``sqrtsoftplus``: ``moe_router_score_func="sqrtsoftplus"`` (transformers ignores it; the
#:   reference runner patches the router), [full, swa, swa] window 6, scaling 2.5.
#: * ``swa_sinks``: ``swa_attention_sink_enabled=True`` (transformers ignores it; the reference
#:   runner adds the sink logit), [full, swa, swa] window 6, heads [4, 6, 8].
LAGUNA_CONFIGS: dict[str, dict[str, Any]] = {
    "xs_mini": _cfg(
        num_hidden_layers=4,
        layer_types=[_FULL, _SLIDING, _SLIDING, _SLIDING],
        sliding_window=7,
        num_attention_heads_per_layer=[4, 8, 8, 6],
        gating="per-head",
        rope_parameters={_FULL: _YARN_EXPLICIT_FACTOR, _SLIDING: _DEFAULT_SLIDING},
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        moe_routed_scaling_factor=2.5,
    ),
    "bool_gate_default_rope": _cfg(
        num_hidden_layers=3,
        layer_types=[_SLIDING, _FULL, _SLIDING],
        sliding_window=6,
        gating=True,
        rope_parameters={_FULL: _DEFAULT_FULL_PARTIAL, _SLIDING: _DEFAULT_SLIDING},
        mlp_layer_types=["sparse", "dense", "sparse"],
        num_experts_per_tok=3,
        moe_router_logit_softcapping=1.0,
    ),
    "per_element_tied": _cfg(
        num_hidden_layers=3,
        layer_types=[_FULL, _SLIDING, _FULL],
        sliding_window=8,
        num_attention_heads_per_layer=[2, 4, 6],
        gating="per-element",
        tie_word_embeddings=True,
        rope_parameters={_FULL: _YARN_DEFAULT_FACTOR, _SLIDING: _DEFAULT_SLIDING},
        mlp_layer_types=["dense", "sparse", "sparse"],
        moe_routed_scaling_factor=1.5,
    ),
    "all_sliding_sparse": _cfg(
        num_hidden_layers=2,
        layer_types=[_SLIDING, _SLIDING],
        sliding_window=6,
        num_attention_heads_per_layer=[2, 6],
        gating="per-head",
        rope_parameters={_FULL: _YARN_EXPLICIT_FACTOR, _SLIDING: _DEFAULT_SLIDING},
        mlp_layer_types=["sparse", "sparse"],
        moe_router_logit_softcapping=2.0,
        moe_routed_scaling_factor=2.5,
    ),
    "full_only": _cfg(
        num_hidden_layers=3,
        layer_types=[_FULL, _FULL, _FULL],
        sliding_window=6,
        gating="per-head",
        rope_parameters={_FULL: _YARN_EXPLICIT_FACTOR, _SLIDING: _DEFAULT_SLIDING},
        mlp_layer_types=["dense", "sparse", "dense"],
    ),
    "sqrtsoftplus": _cfg(
        num_hidden_layers=3,
        layer_types=[_FULL, _SLIDING, _SLIDING],
        sliding_window=6,
        num_attention_heads_per_layer=[4, 6, 4],
        gating="per-head",
        rope_parameters={_FULL: _YARN_EXPLICIT_FACTOR, _SLIDING: _DEFAULT_SLIDING},
        mlp_layer_types=["dense", "sparse", "sparse"],
        moe_routed_scaling_factor=2.5,
        moe_router_score_func="sqrtsoftplus",
    ),
    "swa_sinks": _cfg(
        num_hidden_layers=3,
        layer_types=[_FULL, _SLIDING, _SLIDING],
        sliding_window=6,
        num_attention_heads_per_layer=[4, 6, 8],
        gating="per-head",
        rope_parameters={_FULL: _YARN_EXPLICIT_FACTOR, _SLIDING: _DEFAULT_SLIDING},
        mlp_layer_types=["dense", "sparse", "sparse"],
        moe_routed_scaling_factor=2.5,
        swa_attention_sink_enabled=True,
    ),
}

_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

#: Named tiny Qwen3Config kwarg dicts: ``base`` (untied, all full attention), ``tied``
#: (``tie_word_embeddings=True``) and ``sliding`` (``use_sliding_window=True``, window 6,
#: ``layer_types`` [full, sliding, sliding]).
QWEN3_CONFIGS: dict[str, dict[str, Any]] = {
    "base": copy.deepcopy(_QWEN3_COMMON),
    "tied": copy.deepcopy({**_QWEN3_COMMON, "tie_word_embeddings": True}),
    "sliding": copy.deepcopy(
        {
            **_QWEN3_COMMON,
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,
            "layer_types": [_FULL, _SLIDING, _SLIDING],
        }
    ),
}

#: A fixed prompt used to check that a random model is not degenerate.
_PROBE_IDS = [(37 * i + 3) % 383 + 1 for i in range(24)]

# --------------------------------------------------------------------------------------
# safetensors I/O
# --------------------------------------------------------------------------------------

_INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"


def _weight_files(directory: Path) -> list[Path]:
    """Return the safetensors files of a checkpoint (single file or the shards of an index)."""
    index = directory / _INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / _SINGLE_NAME
    if not single.exists():
        raise FileNotFoundError(f"no {_SINGLE_NAME} or {_INDEX_NAME} in {directory}")
    return [single]


def load_checkpoint_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a (single-file or sharded) safetensors checkpoint into a dict."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(directory)):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in tensors:
                    raise ValueError(f"tensor {name} appears in more than one shard")
                tensors[name] = handle.get_tensor(name)
    return tensors


def _num_shards(directory: Path) -> int:
    """Return how many safetensors files the checkpoint in ``directory`` has."""
    return len(_weight_files(directory))


def save_checkpoint_tensors(
    directory: str | Path,
    tensors: dict[str, torch.Tensor],
    num_shards: int = 1,
    interleave: bool = False,
) -> None:
    """Replace the checkpoint weights in ``directory`` by ``tensors``.

    Removes any existing ``model*.safetensors`` and index first.  ``num_shards == 1`` writes
    ``model.safetensors``; otherwise ``model-0000i-of-0000n.safetensors`` plus the HF index
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": ...}``).
    Tensors are assigned in sorted-name order to contiguous, roughly equal-size shards, so a
    layer's experts may straddle two shards; ``interleave=True`` deals them out round-robin.
    """
    directory = Path(directory)
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if num_shards > len(tensors):
        raise ValueError(f"cannot split {len(tensors)} tensors into {num_shards} shards")
    for old in list(directory.glob("model*.safetensors")) + [directory / _INDEX_NAME]:
        old.unlink(missing_ok=True)
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, str(directory / _SINGLE_NAME), metadata=metadata)
        return

    names = sorted(tensors)
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    if interleave:
        for i, name in enumerate(names):
            groups[i % num_shards].append(name)
    else:
        sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
        total = sum(sizes)
        running = 0
        for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
            shard = min(running * num_shards // max(total, 1), num_shards - 1)
            # never leave a later shard empty: force the tail into the remaining shards
            shard = max(shard, num_shards - (len(names) - i))
            groups[shard].append(name)
            running += size
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        assert group, "empty shard"
        file_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(directory / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(group, file_name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / _INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def shard_checkpoint(
    directory: str | Path, num_shards: int, interleave: bool = False
) -> list[Path]:
    """Rewrite the checkpoint in ``directory`` as ``num_shards`` HF shards plus the index json.

    Works on a single-file or an already-sharded checkpoint; returns the shard paths.
    """
    directory = Path(directory)
    save_checkpoint_tensors(directory, load_checkpoint_tensors(directory), num_shards, interleave)
    return _weight_files(directory)


# --------------------------------------------------------------------------------------
# Tensor-name styles
# --------------------------------------------------------------------------------------

_PER_EXPERT_SUFFIXES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _to_fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert per-expert on-disk names into transformers' fused in-memory names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.", 1)
            head, _, suffix = rest.partition(".")
            if head.isdigit() and suffix in _PER_EXPERT_SUFFIXES:
                experts.setdefault(prefix, {}).setdefault(int(head), {})[suffix] = tensor
                continue
            if rest == "e_score_correction_bias":
                out[f"{prefix}.mlp.gate.e_score_correction_bias"] = tensor
                continue
        out[name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")] = tensor
    for prefix, by_expert in experts.items():
        count = len(by_expert)
        if sorted(by_expert) != list(range(count)):
            raise ValueError(
                f"{prefix}: expert indices are not 0..{count - 1}: {sorted(by_expert)}"
            )
        gate_up, down = [], []
        for e in range(count):
            parts = by_expert[e]
            if set(parts) != set(_PER_EXPERT_SUFFIXES):
                raise ValueError(f"{prefix}.mlp.experts.{e}: incomplete ({sorted(parts)})")
            gate_up.append(torch.cat([parts["gate_proj.weight"], parts["up_proj.weight"]], dim=0))
            down.append(parts["down_proj.weight"])
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack(down)
    return out


def _to_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert transformers' fused in-memory names into the per-expert on-disk names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".mlp.experts.gate_up_proj")]
            if tensor.shape[1] % 2:
                raise ValueError(f"{name}: odd fused dim {tuple(tensor.shape)}")
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = tensor[e, :inter].clone()
                out[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = tensor[e, inter:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".mlp.experts.down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = tensor[e].clone()
        elif name.endswith(".mlp.gate.e_score_correction_bias"):
            prefix = name[: -len(".mlp.gate.e_score_correction_bias")]
            out[f"{prefix}.mlp.experts.e_score_correction_bias"] = tensor
        else:
            out[name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")] = tensor
    return out


def rewrite_checkpoint_names(directory: str | Path, style: Literal["per_expert", "fused"]) -> None:
    """Rewrite the Laguna checkpoint in ``directory`` to the given tensor-name style, in place.

    ``"per_expert"`` is the real on-disk Laguna layout (what ``save_pretrained`` writes):
    ``mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight``,
    ``mlp.experts.e_score_correction_bias`` and ``mlp.shared_expert.*``.
    ``"fused"`` is transformers' in-memory layout: ``mlp.experts.gate_up_proj [E, 2I, H]``
    (gate rows first, then up), ``mlp.experts.down_proj [E, H, I]``,
    ``mlp.gate.e_score_correction_bias`` and ``mlp.shared_experts.*``.
    Idempotent; a sharded checkpoint keeps its shard count.
    """
    directory = Path(directory)
    if style == "fused":
        convert = _to_fused
    elif style == "per_expert":
        convert = _to_per_expert
    else:
        raise ValueError(f"unknown style {style!r}")
    shards = _num_shards(directory)
    tensors = convert(load_checkpoint_tensors(directory))
    save_checkpoint_tensors(directory, tensors, num_shards=min(shards, len(tensors)))


# --------------------------------------------------------------------------------------
# Checkpoint builders
# --------------------------------------------------------------------------------------


def _randomise_parameters(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values that exercise all features.

    Norm weights become ``1 + 0.1*randn`` (q/k norms, layer norms, final norm), the score
    correction bias ``0.1*randn`` (comparable to sigmoid-score gaps, so it changes selection),
    the router ``0.3*randn`` (spread-out scores), the embedding and LM head ``2/sqrt(H)*randn``
    (logit std around 2) and every other matrix ``randn/sqrt(fan_in)`` (std 0.06-0.2 here).
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith("e_score_correction_bias"):
                value = 0.1 * noise
            elif name.endswith("mlp.gate.weight"):
                value = 0.3 * noise
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                value = 2.0 / hidden**0.5 * noise
            elif name.endswith("bias"):
                value = 0.05 * noise
            else:
                value = noise / param.shape[-1] ** 0.5
            param.copy_(value.to(param.dtype))


def _check_not_degenerate(model: torch.nn.Module) -> None:
    """Raise if the model's logits on a fixed prompt have no spread (a useless fixture)."""
    vocab = model.config.vocab_size
    ids = torch.tensor([[i % vocab for i in _PROBE_IDS]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    spread = logits.std(dim=-1).min().item()
    distinct = len(set(logits.argmax(-1).tolist()))
    if not torch.isfinite(logits).all() or spread < 0.5 or distinct < 3:
        raise AssertionError(
            f"degenerate fixture: min logit std {spread:.3f}, {distinct} distinct argmax"
        )


def _laguna_classes() -> tuple[type, type]:
    """Import the Laguna config/model classes lazily (keeps ``import hf_fixtures`` cheap)."""
    from transformers import LagunaConfig, LagunaForCausalLM

    return LagunaConfig, LagunaForCausalLM


def make_laguna_checkpoint(
    directory: str | Path,
    name: str,
    seed: int = 0,
    sink_value: float | None = None,
) -> Path:
    """Build ``LagunaForCausalLM(LagunaConfig(**LAGUNA_CONFIGS[name]))`` and save it to ``directory``.

    The model is float32, every parameter is randomised from ``seed`` (see
    ``_randomise_parameters``) and checked not to be degenerate, ``architectures`` is
    ``["LagunaForCausalLM"]``, and it is written with ``save_pretrained(safe_serialization=True)``
    (per-expert on-disk names, single ``model.safetensors``).  If the config enables
    ``swa_attention_sink_enabled``, a ``model.layers.{l}.self_attn.sink`` tensor of shape
    ``[nh_l]`` is added for each sliding layer: ``1 + randn`` or, if given, ``sink_value``
    everywhere (``float("-inf")`` makes the sinks a no-op).  Returns the directory.
    """
    if name not in LAGUNA_CONFIGS:
        raise KeyError(f"unknown Laguna fixture config {name!r}; known: {sorted(LAGUNA_CONFIGS)}")
    return _build_laguna(Path(directory), copy.deepcopy(LAGUNA_CONFIGS[name]), seed, sink_value)


def _build_laguna(
    directory: Path, kwargs: dict[str, Any], seed: int, sink_value: float | None
) -> Path:
    """Build, randomise, check and save a Laguna model from LagunaConfig ``kwargs``."""
    directory.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls = _laguna_classes()
    config = config_cls(**kwargs)
    config.architectures = ["LagunaForCausalLM"]
    with single_thread():
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        _randomise_parameters(model, seed)
        _check_not_degenerate(model)
        model.save_pretrained(str(directory), safe_serialization=True)
    if getattr(config, "swa_attention_sink_enabled", False):
        _add_sinks(directory, config, seed, sink_value)
    return directory


def _add_sinks(directory: Path, config: Any, seed: int, sink_value: float | None) -> None:
    """Append ``self_attn.sink`` tensors ``[nh_l]`` for the sliding layers of a saved checkpoint."""
    gen = torch.Generator().manual_seed(seed + 7919)
    tensors = load_checkpoint_tensors(directory)
    for layer, layer_type in enumerate(config.layer_types):
        if layer_type != _SLIDING:
            continue
        heads = config.num_attention_heads_per_layer[layer]
        if sink_value is None:
            sink = 1.0 + torch.randn(heads, generator=gen, dtype=torch.float32)
        else:
            sink = torch.full((heads,), float(sink_value), dtype=torch.float32)
        tensors[f"model.layers.{layer}.self_attn.sink"] = sink
    save_checkpoint_tensors(directory, tensors)


def make_laguna_sink_checkpoint(
    directory: str | Path,
    seed: int = 0,
    name: str = "swa_sinks",
    sink_value: float | None = None,
) -> Path:
    """Build a Laguna checkpoint with SWA attention sinks (``swa_attention_sink_enabled: true``).

    Uses config ``name`` with ``swa_attention_sink_enabled=True`` forced on and writes
    ``model.layers.{l}.self_attn.sink`` ``[nh_l]`` float32 for every sliding layer (the name
    vLLM uses).  ``sink_value`` fills all sinks with one value (``float("-inf")`` disables
    them); by default they are ``1 + randn``.  Returns the directory.
    """
    kwargs = {**copy.deepcopy(LAGUNA_CONFIGS[name]), "swa_attention_sink_enabled": True}
    assert _SLIDING in kwargs.get("layer_types", []), f"config {name!r} has no sliding layers"
    return _build_laguna(Path(directory), kwargs, seed, sink_value)


def make_qwen3_checkpoint(
    directory: str | Path,
    seed: int = 0,
    variant: str = "base",
    **overrides: Any,
) -> Path:
    """Build a tiny float32 ``Qwen3ForCausalLM`` from ``QWEN3_CONFIGS[variant]`` + ``overrides``.

    Parameters are randomised like the Laguna fixtures; written with
    ``save_pretrained(safe_serialization=True)`` (``lm_head.weight`` is omitted when tied).
    Returns the directory.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**{**copy.deepcopy(QWEN3_CONFIGS[variant]), **overrides})
    config.architectures = ["Qwen3ForCausalLM"]
    with single_thread():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32).eval()
        _randomise_parameters(model, seed)
        _check_not_degenerate(model)
        model.save_pretrained(str(directory), safe_serialization=True)
    return directory


# --------------------------------------------------------------------------------------
# Config-form rewrites (forms transformers does not read, but real checkpoints use)
# --------------------------------------------------------------------------------------


def _read_config(directory: Path) -> dict[str, Any]:
    """Load ``config.json`` from ``directory``."""
    return json.loads((directory / "config.json").read_text())


def _write_config(directory: Path, config: dict[str, Any]) -> None:
    """Write ``config.json`` to ``directory`` (sorted keys, like ``save_pretrained``)."""
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def rewrite_config_flat_rope(
    directory: str | Path, top_level_rope_theta: bool = True
) -> dict[str, Any]:
    """Convert nested ``rope_parameters`` into the older flat form, in place; return the config.

    ``rope_parameters`` becomes the full-attention dict, ``swa_rope_parameters`` the
    sliding-attention dict, and ``partial_rotary_factor`` (top level) a copy of the full dict's.
    Both dicts get an explicit ``partial_rotary_factor`` (transformers' default 1.0 when absent),
    so the top-level value cannot leak into SWA layers.  With ``top_level_rope_theta`` the full
    dict's ``rope_theta`` is also written at the top level, as old configs did.  transformers
    cannot load the result; it describes the same model for the vLLM-style resolution.
    """
    directory = Path(directory)
    config = _read_config(directory)
    rope = config.get("rope_parameters")
    assert isinstance(rope, dict) and _FULL in rope, f"not a nested rope_parameters dict: {rope!r}"
    assert set(rope) <= {_FULL, _SLIDING}, f"unexpected rope_parameters keys {sorted(rope)}"
    assert "swa_rope_parameters" not in config and "partial_rotary_factor" not in config
    layer_types = config.get("layer_types") or []
    if _SLIDING in layer_types:
        assert rope.get(_SLIDING) is not None, "sliding layers but no sliding_attention rope dict"
    full = dict(rope[_FULL])
    full.setdefault("partial_rotary_factor", 1.0)
    config["rope_parameters"] = full
    config["partial_rotary_factor"] = full["partial_rotary_factor"]
    if rope.get(_SLIDING) is not None:
        sliding = dict(rope[_SLIDING])
        sliding.setdefault("partial_rotary_factor", 1.0)
        config["swa_rope_parameters"] = sliding
    if top_level_rope_theta:
        config["rope_theta"] = full["rope_theta"]
    _write_config(directory, config)
    return config


def rewrite_config_legacy_mlp(directory: str | Path, norm_topk_prob: bool = True) -> dict[str, Any]:
    """Replace ``mlp_layer_types`` by the legacy ``mlp_only_layers`` form, in place; return the config.

    Writes ``mlp_only_layers`` = indices of dense layers and ``decoder_sparse_step: 1`` (so
    every other layer is MoE) and removes ``mlp_layer_types``.  ``norm_topk_prob: true`` is
    also written (as in the release configs; transformers always renormalises), unless
    ``norm_topk_prob`` is False here.  Asserts the legacy form can express the model.
    """
    directory = Path(directory)
    config = _read_config(directory)
    kinds = config.get("mlp_layer_types")
    assert isinstance(kinds, list) and len(kinds) == config["num_hidden_layers"], kinds
    assert set(kinds) <= {"dense", "sparse"}, f"unknown mlp layer types {set(kinds)}"
    assert "mlp_only_layers" not in config and "decoder_sparse_step" not in config
    if "sparse" in kinds:
        assert config.get("num_experts", 0) > 0, "sparse layers need num_experts > 0"
    del config["mlp_layer_types"]
    config["mlp_only_layers"] = [i for i, kind in enumerate(kinds) if kind == "dense"]
    config["decoder_sparse_step"] = 1
    if norm_topk_prob:
        config["norm_topk_prob"] = True
    _write_config(directory, config)
    return config


# --------------------------------------------------------------------------------------
# Reference runners
# --------------------------------------------------------------------------------------


def _sink_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager GQA attention with an optional per-head sink logit (``module.fixture_sink``).

    ``query`` is ``[B, Hq, Tq, D]``, ``key``/``value`` ``[B, Hkv, Tk, D]``, the mask is additive.
    The sink adds one column ``sink_h`` to the scores that enters only the softmax denominator:
    ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij'))``; it has no value vector.
    """
    repeats = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(repeats, dim=1)
    values = value.repeat_interleave(repeats, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : keys.shape[-2]].float()
    sink = getattr(module, "fixture_sink", None)
    if sink is not None:
        column = sink.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(query.dtype)
    output = torch.matmul(probs, values).transpose(1, 2).contiguous()
    return output, probs


@contextlib.contextmanager
def _registered_sink_attention() -> Iterator[str]:
    """Register ``_sink_eager_attention`` (and the eager mask) under a unique name; unregister after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    key = f"fixture_sink_eager_{uuid.uuid4().hex[:8]}"
    AttentionInterface.register(key, _sink_eager_attention)
    AttentionMaskInterface.register(key, eager_mask)
    try:
        yield key
    finally:
        AttentionInterface._global_mapping.pop(key, None)
        AttentionMaskInterface._global_mapping.pop(key, None)


def _sqrtsoftplus_router_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Laguna top-k router with ``score = sqrt(softplus(logit))`` instead of ``sigmoid(logit)``.

    Same contract as ``LagunaTopKRouter.forward``: optional tanh softcap on fp32 logits, the
    correction bias used only for selection, unbiased scores renormalised over the top-k.
    """
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight).float()
    cap = self.router_logit_softcapping
    if cap > 0.0:
        logits = cap * torch.tanh(logits / cap)
    scores = torch.sqrt(F.softplus(logits))
    selected = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
    weights = scores.gather(-1, selected)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(flat.dtype), selected


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch CPU ops on one intra-op thread inside the block, then restore the count.

    The tiny fixture models are faster on one thread, and on a shared 2-core machine
    multi-threaded torch next to another busy process is 10-20x slower (spinning threads).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _quiet_transformers(enabled: bool = True) -> Iterator[None]:
    """Temporarily raise transformers' log level to ERROR (hides expected load reports)."""
    from transformers.utils import logging as hf_logging

    if not enabled:
        yield
        return
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


@contextlib.contextmanager
def hf_reference_model(
    directory: str | Path,
    sinks: bool | None = None,
    dtype: torch.dtype = torch.float32,
) -> Iterator[Any]:
    """Load the checkpoint in ``directory`` with transformers as the reference model.

    Eager attention, eager experts, ``dtype`` weights, eval mode, one torch thread inside
    the block (see ``single_thread``).  Laguna extras that
    transformers ignores are patched into THIS model instance only, for the duration of the
    context: ``moe_router_score_func: "sqrtsoftplus"`` in config.json replaces each router's
    forward; sinks (``sinks=None`` follows ``swa_attention_sink_enabled`` in config.json) load
    ``self_attn.sink`` from the checkpoint onto the sliding layers and use a uniquely named
    registered attention function which is unregistered on exit.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    config = _read_config(directory)
    use_sinks = bool(config.get("swa_attention_sink_enabled", False)) if sinks is None else sinks
    score_func = config.get("moe_router_score_func", "sigmoid")
    if score_func not in ("sigmoid", "sqrtsoftplus"):
        raise NotImplementedError(f"moe_router_score_func={score_func!r}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(single_thread())
        attn_impl = stack.enter_context(_registered_sink_attention()) if use_sinks else "eager"
        kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_impl}
        if config.get("num_experts"):
            kwargs["experts_implementation"] = "eager"
        with _quiet_transformers(use_sinks):  # the sink tensors are "unexpected" to transformers
            model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs).eval()
        if use_sinks:
            tensors = load_checkpoint_tensors(directory)
            found = 0
            for layer, layer_type in enumerate(model.config.layer_types):
                if layer_type != _SLIDING:
                    continue
                attn = model.model.layers[layer].self_attn
                sink = tensors.get(f"model.layers.{layer}.self_attn.sink")
                if sink is None:
                    raise KeyError(
                        f"sinks requested but model.layers.{layer}.self_attn.sink is missing"
                    )
                assert sink.shape == (attn.num_heads,), (sink.shape, attn.num_heads)
                attn.fixture_sink = sink.to(dtype)
                found += 1
            if not found:
                raise ValueError("sinks requested but the model has no sliding layers")
        if score_func == "sqrtsoftplus":
            for module in model.modules():
                if type(module).__name__ == "LagunaTopKRouter":
                    module.forward = types.MethodType(_sqrtsoftplus_router_forward, module)
        yield model


def hf_prompt_logits(
    directory: str | Path,
    input_ids: Sequence[int],
    sinks: bool | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Return transformers' logits ``[T, V]`` (float32) for one prompt, with no KV cache."""
    with hf_reference_model(directory, sinks=sinks, dtype=dtype) as model, torch.no_grad():
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        logits = model(input_ids=ids, use_cache=False).logits[0]
    return logits.float()


def hf_greedy(
    directory: str | Path,
    input_ids: Sequence[int],
    max_new_tokens: int,
    sinks: bool | None = None,
    use_cache: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[int]:
    """Greedy continuation (new tokens only) of ``input_ids`` by transformers.

    With ``use_cache`` (default) the prompt is prefilled into a ``DynamicCache`` (sliding
    layers keep ``W - 1`` keys) and each new token is fed alone with explicit positions;
    otherwise every step recomputes the full sequence.  Stops early after emitting a token in
    ``eos_token_id`` if given; otherwise exactly ``max_new_tokens`` tokens.
    """
    from transformers import DynamicCache

    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    sequence = list(input_ids)
    new_tokens: list[int] = []
    with hf_reference_model(directory, sinks=sinks, dtype=dtype) as model, torch.no_grad():
        cache = DynamicCache(config=model.config) if use_cache else None
        feed = sequence
        for _ in range(max_new_tokens):
            if use_cache:
                start = len(sequence) - len(feed)
                positions = torch.arange(start, len(sequence)).unsqueeze(0)
                out = model(
                    input_ids=torch.tensor([feed]),
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
            else:
                out = model(input_ids=torch.tensor([sequence]), use_cache=False)
            token = int(out.logits[0, -1].float().argmax())
            sequence.append(token)
            new_tokens.append(token)
            feed = [token]
            if token in stops:
                break
    return new_tokens


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

#: Special tokens of the fixture tokenizer, in id order (ids 0..7).
TOKENIZER_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|mask|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)

#: Jinja chat template: ``<|bos|>`` then ``<|role|>content<|end|>`` per message, then
#: ``<|assistant|>`` when ``add_generation_prompt``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS_MODULES = (
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "fnmatch.py",
    "shlex.py",
    "colorsys.py",
)
_CORPUS_PROSE = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a block of tokens "
    "with a small model and verifies them with the large one in a single forward pass. "
    "def main():\n    print('hello, world')\n    return 0\n"
)


def _tokenizer_corpus() -> list[str]:
    """Return training text: a few stdlib Python sources plus a short built-in paragraph."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [_CORPUS_PROSE] * 20
    for module in _CORPUS_MODULES:
        path = stdlib / module
        if path.exists():
            texts.append(path.read_text(encoding="utf-8"))
    return texts


def make_tokenizer(directory: str | Path, vocab_size: int, update_model_config: bool = True) -> int:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` tokens into ``directory``.

    Ids 0..7 are ``TOKENIZER_SPECIAL_TOKENS`` (pad 0, bos 1, eos 2, mask 3, system 4, user 5,
    assistant 6, end 7), then the 256 byte symbols and BPE merges learnt from stdlib sources;
    if the trainer stops short, ``<|reserved_i|>`` special tokens fill up to ``vocab_size``.
    Writes ``tokenizer.json``, ``tokenizer_config.json`` (bos/eos/pad/mask tokens and
    ``CHAT_TEMPLATE``) and ``generation_config.json`` (bos, pad and ``eos_token_id`` =
    ``[eos, end]`` like Laguna's ``[2, 24]``).  If ``update_model_config`` and a
    ``config.json`` exists, its bos/eos/pad ids are set the same way.  Returns the eos id.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    minimum = len(TOKENIZER_SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (specials + 256 byte symbols)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TOKENIZER_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    filler = 0
    while tokenizer.get_vocab_size() < vocab_size:
        tokenizer.add_special_tokens([f"<|reserved_{filler}|>"])
        filler += 1
    if tokenizer.get_vocab_size() != vocab_size:
        raise AssertionError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}"
        )
    ids = {token: tokenizer.token_to_id(token) for token in TOKENIZER_SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(len(TOKENIZER_SPECIAL_TOKENS))), ids
    tokenizer.save(str(directory / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "mask_token": "<|mask|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    eos_ids = [ids["<|eos|>"], ids["<|end|>"]]
    special = {
        "bos_token_id": ids["<|bos|>"],
        "eos_token_id": eos_ids,
        "pad_token_id": ids["<|pad|>"],
    }
    generation_path = directory / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    generation.update(special)
    generation_path.write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if update_model_config and (directory / "config.json").exists():
        config = _read_config(directory)
        if config.get("vocab_size") not in (None, vocab_size):
            raise ValueError(
                f"config.json vocab_size {config['vocab_size']} != tokenizer {vocab_size}"
            )
        config.update(special)
        _write_config(directory, config)
    return ids["<|eos|>"]
