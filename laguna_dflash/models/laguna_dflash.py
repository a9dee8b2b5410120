"""Poolside Laguna DFlash drafter (``DFlashLagunaForCausalLM``): what differs from the base.

Differences (reference/laguna.md section 4.4): per-tap ``aux_hidden_norms`` before ``fc``;
``hidden_norm`` inside :meth:`combine_hidden_states`; each layer's ``input_layernorm`` applied
to the context before its K/V projection; softplus output gate; dense Laguna MLP; RoPE from the
drafter's own config; uniform layer types; sliding window only as a compute-time limit (the KV
allocation is full, context written at absolute positions); causal block per
``dflash_config.causal``.

Fused precompute. Layer ``l`` reads ``RMSNorm_l(c) = w_l * n(c)`` with ``n(c) = c / rms(c)``; the
statistic ``rms(c)`` is the same for every layer, so ``W_l (w_l * n(c)) = (W_l diag(w_l)) n(c)``:
the per-layer norm weights fold into the stacked K/V rows and one normalisation plus one GEMM
serve all layers.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import SINGLE, TensorParallel
from . import fusion
from .config_utils import ConfigReader
from .decoder import Group
from .dflash import (
    DFlashDraftModel,
    DraftLayerSpec,
    DraftSpec,
    check_target_compat,
    dflash_int,
    dflash_value,
    resolve_draft_tp,
    resolve_target_layer_ids,
)
from .fusion import rms_norm_interleaved
from .laguna import resolve_gating, resolve_layer_rope
from .layers import DecoderLayer, RMSNorm, linear
from .rope import RopeSpec


def laguna_draft_spec(cfg: dict, shapes: dict | None, target: nn.Module | None) -> DraftSpec:
    arch = "DFlashLagunaForCausalLM"
    r = ConfigReader(cfg, arch)
    shapes = shapes or {}
    num_layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")
    num_heads = r.int("num_attention_heads")
    head_dim = r.int("head_dim", hidden // num_heads)
    layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
    r.check_len("layer_types", layer_types, num_layers)
    if cfg.get("gating_types"):
        r.check_len("gating_types", cfg["gating_types"], num_layers)
    if len(set(layer_types)) != 1:
        raise ValueError(
            f"{arch}: layer_types must be uniform (all sliding_attention or all full_attention), "
            f"got {layer_types}"
        )
    if cfg.get("num_experts"):
        raise ValueError(f"{arch}: the drafter MLP is dense; num_experts must be 0, got {cfg['num_experts']}")
    if "rope_theta" not in cfg and not cfg.get("rope_parameters"):
        raise ValueError(
            f"{arch}: config.json needs rope_theta (the drafter's own RoPE; never the target's SWA theta)"
        )
    taps = resolve_target_layer_ids(cfg, arch) or []
    check_target_compat(cfg, target, list(taps), arch)
    if target is not None:
        vocab = target.spec.vocab_size
        # null counts as absent: the drafter then uses the target vocabulary
        draft_vocab = next((cfg[k] for k in ("draft_vocab_size", "vocab_size") if cfg.get(k) is not None), vocab)
        if draft_vocab != vocab:
            raise ValueError(
                f"{arch}: draft_vocab_size={draft_vocab} differs from the target vocabulary {vocab}; "
                "Laguna drafters share the target's embedding and lm_head, so they must be equal "
                "(to draft among fewer tokens, keep the target's vocabulary in config.json and pass "
                "--speculative-token-map)"
            )
    mask_id = dflash_value(cfg, "mask_token_id")
    if mask_id is None:
        raise ValueError(f"{arch}: config needs dflash_config.mask_token_id")
    is_sliding = layer_types[0] == "sliding_attention"
    window = cfg.get("sliding_window")
    if is_sliding and not window:
        raise ValueError(f"{arch}: sliding_attention layers need sliding_window in config.json")
    causal = dflash_value(cfg, "causal")
    if causal is None:
        causal = cfg.get("is_causal", is_sliding)
    layers = tuple(
        DraftLayerSpec(
            sliding_window=int(window) if is_sliding else None, is_causal=bool(causal),
            gating=resolve_gating(cfg, i, num_heads, head_dim,
                                  (shapes.get(f"layers.{i}.self_attn.g_proj.weight") or (None,))[0]),
        )
        for i in range(num_layers)
    )
    max_pos = r.int("max_position_embeddings", 262144)
    rope = RopeSpec.from_dict(resolve_layer_rope(cfg, layer_types[0]), head_dim, max_pos)
    target_hidden = target.spec.hidden_size if target is not None else hidden
    return DraftSpec(
        hidden_size=hidden, target_hidden_size=r.int("target_hidden_size", target_hidden),
        num_heads=num_heads, num_kv_heads=r.int("num_key_value_heads", num_heads), head_dim=head_dim,
        intermediate_size=r.int("intermediate_size"), rope=rope, layers=layers,
        target_layer_ids=tuple(int(t) for t in taps), block_size=dflash_int(cfg, "block_size", arch, 16, 2),
        mask_token_id=dflash_int(cfg, "mask_token_id", arch, 0), rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        qkv_bias=bool(cfg.get("attention_bias", False)),
    )


def _versions(weights: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """Each tensor's storage and version counter; None if one has none (an inference tensor:
    made under ``torch.inference_mode``, its in-place changes cannot be seen)."""
    if any(w.is_inference() for w in weights):
        return None
    return [(w.data_ptr(), w._version) for w in weights]


class DFlashLaguna(DFlashDraftModel):
    """Laguna flavour of the DFlash drafter."""

    architecture = "DFlashLagunaForCausalLM"
    fused_qkv_on_disk = True  # Poolside checkpoints store the fused qkv_proj

    def __init__(self, spec: DraftSpec, target: nn.Module | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(spec, target, tp)
        # the tap norms' weights stacked after loading, and the storage / versions they had then
        self._aux_norm_stack: torch.Tensor | None = None
        self._aux_norm_stack_key: list[tuple[int, int]] | None = None
        self.aux_hidden_norms = nn.ModuleList(
            RMSNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in spec.target_layer_ids
        )

    @classmethod
    def from_config(cls, cfg: dict, shapes: dict | None = None, target: nn.Module | None = None,
                    tp: TensorParallel | None = None):
        spec = laguna_draft_spec(cfg, shapes, target)
        return cls(spec, target, resolve_draft_tp(spec, target, tp))

    def checkpoint_groups(self, prefix: str = "") -> list[Group]:
        groups = super().checkpoint_groups(prefix)
        groups += [[[(f"{prefix}aux_hidden_norms.{j}.weight", norm.weight)]]
                   for j, norm in enumerate(self.aux_hidden_norms)]
        return groups

    def combine_hidden_states(self, taps: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat_j aux_norm_j(tap_j)))`` for taps ``[N, n_taps * H_t]``; the
        per-tap norms run as one launch over the taps as they lie (``rms_norm_interleaved``),
        ``fc`` as the skinny GEMM where :func:`linear` takes it (decode-size CUDA graphs)."""
        x = rms_norm_interleaved(taps.to(self.fc.weight.dtype).contiguous(), self._aux_norm_weights(),
                                 self.spec.rms_norm_eps)
        return self.hidden_norm(linear(x, self.fc.weight, self.fc.bias))

    def _aux_norm_weights(self) -> torch.Tensor:
        """The per-tap norm weights stacked, ``[n_taps, H_t]``. Without autograd, the copy made
        after loading (:meth:`_build_context_kv_buffers`) while every weight is the tensor it was
        stacked from, unchanged since (same storage, same version counter), so a decode-step
        CUDA graph holds no stack launch; otherwise stacked anew (with autograd: differentiable)."""
        weights = [norm.weight for norm in self.aux_hidden_norms]
        if (self._aux_norm_stack is not None and not torch.is_grad_enabled()
                and self._aux_norm_stack_key == _versions(weights)):
            return self._aux_norm_stack
        return torch.stack(weights)

    def _build_context_kv_buffers(self) -> None:
        """Stacked K|V rows with each layer's ``input_layernorm`` weight folded into its columns;
        the per-tap norm weights stacked (:meth:`_aux_norm_weights`)."""
        weights = [norm.weight.detach() for norm in self.aux_hidden_norms]
        key = _versions(weights)
        self._aux_norm_stack = torch.stack(weights) if key is not None else None
        self._aux_norm_stack_key = key
        super()._build_context_kv_buffers()
        kv = 2 * self.num_kv_heads * self.spec.head_dim
        ln = torch.cat([layer.input_layernorm.weight.view(1, -1).expand(kv, -1) for layer in self.layers])
        self.context_kv_weight = (self.context_kv_weight.float() * ln.float()).to(self.context_kv_weight.dtype)

    def _project_context_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight-free RMS normalisation (shared statistic), then ONE GEMM with folded weights."""
        x = fusion.rms_norm_unweighted(context, self.spec.rms_norm_eps)
        return self._split_context_kv(linear(x, self.context_kv_weight, self.context_kv_bias))

    def context_kv_input(self, layer: DecoderLayer, context: torch.Tensor) -> torch.Tensor:
        return layer.input_layernorm(context)
