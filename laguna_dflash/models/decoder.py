"""The decoder-only causal LM shared by the Laguna and Qwen3 target families.

A family module turns its HF ``config.json`` into a :class:`ModelSpec`; this module builds the
network from it and declares where each parameter comes from on disk
(:meth:`DecoderLM.checkpoint_groups`), so there is one implementation of the forward pass and
one of the name mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import SINGLE, Split, TensorParallel
from ..kernels import batch_invariant, greedy_lm_head
from ..kernels.availability import triton_can_run
from .layers import (
    MLP,
    Attention,
    DecoderLayer,
    ForwardContext,
    MoE,
    RMSNorm,
    VocabParallelEmbedding,
    lm_head_linear,
    run_layers,
)
from .rope import RopeSpec, RotaryEmbedding

# A destination is a (disk tensor name, view of a parameter to copy into) or, for a parameter
# sharded by tensor parallelism, (name, view, which part of the disk tensor this rank holds).
Destination = tuple[str, torch.Tensor] | tuple[str, torch.Tensor, Split | None]
# A group lists alternative on-disk spellings of the same parameters; the loader picks the first
# option whose first name is present in the checkpoint.
Group = list[list[Destination]]


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    routed_scaling_factor: float = 1.0
    logit_softcapping: float = 0.0
    score_func: str = "sigmoid"
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class LayerSpec:
    num_heads: int
    rope: RopeSpec
    sliding_window: int | None = None
    gating: str | None = None
    has_sinks: bool = False
    is_moe: bool = False


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    moe: MoESpec | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def build_rotaries(layer_ropes: list[RopeSpec]) -> tuple[list[RotaryEmbedding], dict]:
    """One :class:`RotaryEmbedding` per distinct spec; returns (unique list, spec -> rotary)."""
    by_spec: dict[RopeSpec, RotaryEmbedding] = {}
    for spec in layer_ropes:
        if spec not in by_spec:
            by_spec[spec] = RotaryEmbedding(spec)
    return list(by_spec.values()), by_spec


class DecoderLM(nn.Module):
    """Embedding, pre-norm decoder layers, final RMSNorm, (tied or untied) lm_head.

    ``tp``: this rank's tensor-parallel shard (distributed.py); the spec keeps the checkpoint's
    full sizes, the modules hold the rank's part, and the forward's outputs (hidden states,
    taps, logits) are the full ones on every rank."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.rotaries, by_spec = build_rotaries([layer.rope for layer in spec.layers])
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(self._make_attention(i, layer, by_spec[layer.rope]),
                         self._make_mlp(layer), spec.hidden_size, spec.rms_norm_eps)
            for i, layer in enumerate(spec.layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_word_embeddings:  # this rank's vocabulary rows (as the embedding's)
            self.lm_head = nn.Linear(spec.hidden_size, self.embed_tokens.num_embeddings, bias=False)

    def _make_attention(self, index: int, layer: LayerSpec, rotary: RotaryEmbedding) -> Attention:
        s = self.spec
        return Attention(
            s.hidden_size, layer.num_heads, s.num_kv_heads, s.head_dim, rotary,
            cache_index=index, sliding_window=layer.sliding_window, gating=layer.gating,
            has_sinks=layer.has_sinks, qkv_bias=s.qkv_bias, o_bias=s.o_bias, eps=s.rms_norm_eps,
            tp=self.tp,
        )

    def _make_mlp(self, layer: LayerSpec) -> nn.Module:
        s = self.spec
        if not layer.is_moe:
            return MLP(s.hidden_size, s.intermediate_size, tp=self.tp)
        m = s.moe
        assert m is not None
        return MoE(
            s.hidden_size, m.num_experts, m.top_k, m.moe_intermediate_size,
            m.shared_intermediate_size, routed_scaling_factor=m.routed_scaling_factor,
            logit_softcapping=m.logit_softcapping, score_func=m.score_func,
            norm_topk_prob=m.norm_topk_prob, tp=self.tp,
        )

    # ---- runtime -------------------------------------------------------------------------------

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank's cache holds: ``num_kv_heads / tensor_parallel_size``."""
        return self.spec.num_kv_heads // self.tp.world_size

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V / world_size, H]``: this rank's rows of the output projection (of the embedding
        matrix when tied)."""
        return self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def prepare_rope(self, max_positions: int, device: torch.device | str) -> None:
        """Build the cos/sin tables for positions ``< max_positions`` on ``device``."""
        for rotary in self.rotaries:
            rotary.ensure(max_positions)
            rotary.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        tap_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over the flat batch.

        input_ids [T] int64 -> (final-normed hidden ``[T, H]``, taps ``[T, n_taps * H]`` or None).
        Tap ``i`` is the OUTPUT of layer ``i`` (residual stream before the final norm, HF's
        ``hidden_states[i + 1]``), concatenated in ``tap_layer_ids`` order.
        """
        hidden, taps = run_layers(self.layers, self.embed_tokens(input_ids), ctx, self.norm, tap_layer_ids)
        tapped = torch.cat([taps[i] for i in tap_layer_ids], dim=-1) if tap_layer_ids else None
        return hidden, tapped

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` (final-normed) -> logits ``[N, V]`` in the weights' dtype (the engine's
        consumers, argmax and the float32 sampling / logprob paths, widen exactly themselves);
        row ``n``'s independent of ``N`` inside ``batch_invariant.scope``. With tensor
        parallelism each rank computes its vocabulary columns and all ranks gather the rest."""
        if batch_invariant.is_active():
            return self.tp.all_gather_last(batch_invariant.linear(hidden, self.lm_head_weight))
        return self.tp.all_gather_last(lm_head_linear(hidden, self.lm_head_weight))

    lm_head_int8: greedy_lm_head.Int8LmHead | None = None

    def quantize_lm_head_int8(self) -> int:
        """Build the lm_head's int8 copy for :meth:`greedy_tokens` (kernels/greedy_lm_head.py):
        its bytes, or 0 where it does not apply (tensor parallelism, a weight that is not bf16 /
        fp16 and contiguous, or a device Triton does not run on)."""
        weight = self.lm_head_weight
        if (self.tp.is_parallel or weight.dtype not in (torch.bfloat16, torch.float16)
                or not weight.is_contiguous() or not triton_can_run(weight.device)):
            return 0
        self.lm_head_int8 = greedy_lm_head.quantize(weight)
        return self.lm_head_int8.nbytes

    def greedy_tokens(self, hidden: torch.Tensor, also_into: torch.Tensor | None = None) -> torch.Tensor | None:
        """``torch.argmax`` of the logits of ``hidden [N, H]`` (final-normed), each row's, through
        the int8 copy (:meth:`quantize_lm_head_int8`) -> ``[N]`` int64, also stored into
        ``also_into`` (``[N]`` int64) if given; None where that copy is missing or does not take
        ``hidden`` (then the caller computes the logits, and ``also_into`` is not written)."""
        head = self.lm_head_int8
        if (head is None or batch_invariant.is_active()
                or not greedy_lm_head.can_use(hidden, self.lm_head_weight, head)):
            return None
        return greedy_lm_head.greedy_tokens(hidden, self.lm_head_weight, head, also_into)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` (final-normed) -> logits ``[N, V]`` float32."""
        return self.lm_head_logits(hidden).float()

    # ---- checkpoint layout -----------------------------------------------------------------------

    def ignorable_tensors(self, prefix: str = "model.") -> set[str]:
        """On-disk tensors that may be present but are not loaded: a tied lm_head copy; with
        expert parallelism, the other ranks' experts (per-expert spelling)."""
        names = {"lm_head.weight"} if self.spec.tie_word_embeddings else set()
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, MoE):
                names |= other_ranks_expert_names(layer.mlp, f"{prefix}layers.{i}.mlp.")
        return names

    def checkpoint_groups(self, prefix: str = "model.") -> list[Group]:
        """Where every parameter comes from on disk (HF names; split or fused alternatives)."""
        rows = self.tp.split(0)
        groups: list[Group] = [
            [[(f"{prefix}embed_tokens.weight", self.embed_tokens.weight, rows)]],
            [[(f"{prefix}norm.weight", self.norm.weight)]],
        ]
        if not self.spec.tie_word_embeddings:
            groups.append([[("lm_head.weight", self.lm_head.weight, rows)]])
        for i, layer in enumerate(self.layers):
            p = f"{prefix}layers.{i}."
            groups += [
                [[(p + "input_layernorm.weight", layer.input_layernorm.weight)]],
                [[(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)]],
            ]
            groups += attention_groups(layer.self_attn, p + "self_attn.")
            if isinstance(layer.mlp, MoE):
                groups += moe_groups(layer.mlp, p + "mlp.")
            else:
                groups += mlp_groups(layer.mlp, p + "mlp.")
        return groups


def attention_groups(attn: Attention, p: str, fused_first: bool = False) -> list[Group]:
    """q/k/v split on disk (HF) or fused ``qkv_proj`` (Poolside drafter), plus o/g/norms/sinks.

    ``fused_first`` makes the fused spelling canonical (what the writer emits). With tensor
    parallelism a rank reads its heads' rows (of each of Q, K and V in the fused spelling) and
    its heads' ``o_proj`` columns.
    """
    q, kv = attn.q_size, attn.kv_size
    rows, cols, qkv_rows = attn.tp.split(0), attn.tp.split(1), attn.tp.split(0, (q, kv, kv))
    qkv: Group = []
    for name, t in (("weight", attn.qkv_proj.weight), ("bias", attn.qkv_proj.bias)):
        if t is None:
            continue
        spellings = [
            [(f"{p}q_proj.{name}", t[:q], rows), (f"{p}k_proj.{name}", t[q : q + kv], rows),
             (f"{p}v_proj.{name}", t[q + kv :], rows)],
            [(f"{p}qkv_proj.{name}", t, qkv_rows)],
        ]
        qkv.append(spellings[::-1] if fused_first else spellings)
    groups: list[Group] = qkv + [[[(p + "o_proj.weight", attn.o_proj.weight, cols)]]]
    if attn.o_proj.bias is not None:
        groups.append([[(p + "o_proj.bias", attn.o_proj.bias)]])
    if attn.gating is not None:
        groups.append([[(p + "g_proj.weight", attn.g_proj.weight, rows)]])
    groups += [[[(p + "q_norm.weight", attn.q_norm.weight)]], [[(p + "k_norm.weight", attn.k_norm.weight)]]]
    if attn.sinks is not None:
        groups.append([[(p + "sink", attn.sinks, rows)], [(p + "sinks", attn.sinks, rows)]])
    return groups


def mlp_groups(mlp: MLP, p: str) -> list[Group]:
    """Dense SwiGLU: split ``gate_proj``/``up_proj`` or fused ``gate_up_proj``; ``down_proj``
    (with tensor parallelism: the rank's rows of gate and up, its columns of down)."""
    i = mlp.intermediate_size
    w = mlp.gate_up_proj.weight
    rows = mlp.tp.split(0)
    return [
        [[(p + "gate_proj.weight", w[:i], rows), (p + "up_proj.weight", w[i:], rows)],
         [(p + "gate_up_proj.weight", w, mlp.tp.split(0, (i, i)))]],
        [[(p + "down_proj.weight", mlp.down_proj.weight, mlp.tp.split(1))]],
    ]


_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def moe_groups(moe: MoE, p: str) -> list[Group]:
    """Real Laguna on-disk names (per expert, ``shared_expert``, bias under ``experts.``) or the
    fused names transformers uses in memory (``experts.gate_up_proj [E, 2I, H]``,
    ``gate.e_score_correction_bias``, ``shared_experts``). Tensor parallelism: every expert's
    rows of gate and up and columns of down; expert parallelism: this rank's experts whole
    (the per-expert names of its ids, the fused tensors' slice of the expert dimension)."""
    im = moe.intermediate_size
    if moe.tp.shards_experts:
        rows = cols = None
        fused_gate_up, fused_down = moe.tp.split(0), moe.tp.split(0)
    else:
        rows, cols = moe.tp.split(0), moe.tp.split(1)
        fused_gate_up, fused_down = moe.tp.split(1, (im, im)), moe.tp.split(2)
    per_expert: list[Destination] = []
    for local in range(moe.num_local_experts):
        gu, e = moe.experts_gate_up[local], moe.first_expert + local
        per_expert += [
            (f"{p}experts.{e}.gate_proj.weight", gu[:im], rows),
            (f"{p}experts.{e}.up_proj.weight", gu[im:], rows),
            (f"{p}experts.{e}.down_proj.weight", moe.experts_down[local], cols),
        ]
    fused = [(p + "experts.gate_up_proj", moe.experts_gate_up, fused_gate_up),
             (p + "experts.down_proj", moe.experts_down, fused_down)]
    groups: list[Group] = [
        [[(p + "gate.weight", moe.gate.weight)]],
        [[(p + "experts.e_score_correction_bias", moe.e_score_correction_bias)],
         [(p + "gate.e_score_correction_bias", moe.e_score_correction_bias)]],
        [per_expert, fused],
    ]
    if moe.shared_expert is not None:
        # On disk "shared_expert." (singular); transformers in memory "shared_experts.".
        singular = mlp_groups(moe.shared_expert, p + "shared_expert.")
        plural = mlp_groups(moe.shared_expert, p + "shared_experts.")
        groups += [
            [singular[0][0], plural[0][0], singular[0][1], plural[0][1]],
            [singular[1][0], plural[1][0]],
        ]
    return groups


def other_ranks_expert_names(moe: MoE, p: str) -> set[str]:
    """The per-expert on-disk names of the experts other ranks hold (expert parallelism)."""
    mine = range(moe.first_expert, moe.first_expert + moe.num_local_experts)
    return {f"{p}experts.{e}.{name}.weight" for e in range(moe.num_experts) if e not in mine
            for name in _EXPERT_PROJECTIONS}
