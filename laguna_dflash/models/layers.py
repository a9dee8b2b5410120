"""Building blocks shared by every model family: RMSNorm, attention, SwiGLU MLP, sigmoid MoE.

Weights are stored fused the way the fast path wants them (``qkv_proj`` rows Q|K|V,
``gate_up_proj`` rows gate|up, experts stacked ``[E, 2I, H]`` / ``[E, H, I]``); the loader maps
the split on-disk names onto row slices of these tensors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import SINGLE, TensorParallel
from ..engine.attention import AttentionBackend, AttentionMetadata
from ..kernels import (
    batch_invariant,
    fused_moe,
    greedy_lm_head,
    grouped_moe,
    l2_prefetch,
    moe_gemv,
    moe_routing,
    precompile,
    qk_norm_rope_cache,
    qkv_norm_rope_cache,
    skinny_gemm,
    staged_gemv,
)
from . import fp8, fusion
from .rope import RotaryEmbedding

logger = logging.getLogger(__name__)

# Decode-phase GEMMs (M <= 16 rows: decode, verify, the drafter block) through the Triton skinny
# GEMM (kernels/skinny_gemm.py) on CUDA; False: cuBLAS everywhere (an A/B switch for benchmarks).
use_skinny_gemm = True
# Only while a CUDA graph is built (engine.cuda_graph.capture_graph: its warm-ups and the
# capture): the kernel saves GPU time, but its Python launch costs more host time than a cuBLAS
# call, which a replay does not pay and an eager forward (enforce_eager, prefill, fallbacks) does.
_num_graph_builds = 0
# Batch-1 o_proj through the staged GEMV (kernels/staged_gemv.py: its weight parked in shared
# memory before the PDL wait, while attention and the split merge, which then signal early, run)
# where it runs (sm_90+, bf16 / fp16, tiling shapes) and a CUDA graph is built. On the H200 at
# Laguna-XS-2.1 size: decode graph 2.22 -> 2.19 ms (docs/PERFORMANCE.md, thirteenth pass).
use_staged_o_proj = True
# One token only (the staged GEMV is a one-row kernel): the K = 3 verify's and the drafter
# block's o_proj go through row_parallel_linear (the skinny GEMM in the graphs). Every staged
# 2-4 row kernel tried made those graphs slower on the H200 (docs/PERFORMANCE.md, fourteenth,
# sixty-third and sixty-sixth passes; in the last, 4-token verify 3.79-4.55 against 3.68 ms,
# drafter block 0.35-0.46 against 0.33 ms). Those configs parked as much as the one-row kernel
# (16.8 MB a launch); benchmarks/gpu_check.sh pass109 times the tensor-core one parking less,
# from 5d91d44, the last tree with it (sixty-eighth pass).
# The dense MLPs' SwiGLU (the drafter's layers, the target's first layer) as the epilogue of the
# skinny gate|up GEMM (skinny_gemm(..., glu=True): bitwise the GEMM then kernels/silu_mul.py, in
# one launch) wherever :func:`linear` takes the skinny GEMM for that gate|up; False: the GEMM and
# the activation kernel as two launches (an A/B switch for benchmarks).
use_glu_epilogue = True
# The lm_head (decode, verify and draft rows: M <= 16) through the skinny GEMM where a measured
# config covers its (M, V, H), eagerly as well (it runs outside the graphs; the host is ahead of
# the GPU there); False: cuBLAS (an A/B switch for benchmarks).
use_skinny_lm_head = True


@contextlib.contextmanager
def building_cuda_graph() -> Iterator[None]:
    """Scope of a CUDA-graph build: :func:`linear` may take the skinny GEMM inside it."""
    global _num_graph_builds
    _num_graph_builds += 1
    try:
        yield
    finally:
        _num_graph_builds -= 1


def is_building_cuda_graph() -> bool:
    """Whether a CUDA graph is being built (:func:`building_cuda_graph`: its warm-up runs, its
    capture, the recordings that build its kernels ahead): kernels may then choose for a replay,
    not for an eager forward."""
    return _num_graph_builds > 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias)`` -> ``[M, N]`` in x's dtype. Inference on CUDA
    while a CUDA graph is built, with M <= 16, no bias and a shape the skinny GEMM was tuned for
    (where it beat cuBLAS on the H200: it streams the weight once, split-K reduced in the same
    launch); otherwise ``F.linear``. Inside ``batch_invariant.scope``: always
    :func:`batch_invariant.linear` (row results independent of ``M``). ``scale [N]``: ``weight``
    is fp8 rows with these scales (``models/fp8.py``, :func:`fp8.fp8_linear`)."""
    if scale is not None:
        return fp8.fp8_linear(x, weight, scale, bias)
    if batch_invariant.is_active():
        return batch_invariant.linear(x, weight, bias)
    if _takes_skinny(x, weight, bias):
        return skinny_gemm.skinny_gemm(x, weight)
    return F.linear(x, weight, bias)


def _takes_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # the rule of :func:`linear`'s skinny branch (batch-invariant scope aside)
    return (is_building_cuda_graph() and bias is None and use_skinny_gemm and x.is_cuda
            and not torch.is_grad_enabled() and skinny_gemm.can_use(x, weight)
            and skinny_gemm.is_tuned(x.shape[0], weight.shape[0], weight.shape[1]))


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, unquantized: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of a dense MLP: ``silu(g) * u`` of ``[g | u] = x [M, K] @ weight [2I, K]^T (+ bias)``
    -> ``[M, I]`` in x's dtype. Where :func:`linear` takes the skinny GEMM for this gate|up and
    :data:`use_glu_epilogue` is on: one launch with the activation as its epilogue (bitwise
    the two-launch result); otherwise :func:`linear` then ``fusion.silu_mul``. ``scale``: fp8
    rows (:func:`fp8.fp8_linear`, the epilogue wherever its skinny GEMM runs; ``unquantized``:
    the weight before quantization, for CUDA launches past 16 rows)."""
    if scale is not None:
        if use_glu_epilogue:
            return fp8.fp8_linear(x, weight, scale, bias, glu=True, unquantized=unquantized)
        return fusion.silu_mul(fp8.fp8_linear(x, weight, scale, bias, unquantized=unquantized))
    if use_glu_epilogue and not batch_invariant.is_active() and _takes_skinny(x, weight, bias):
        return skinny_gemm.skinny_gemm(x, weight, glu=True)
    return fusion.silu_mul(linear(x, weight, bias))


def lm_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits ``x [M, H] @ weight [V, H]^T`` -> ``[M, V]`` in x's dtype: the skinny GEMM where
    :data:`use_skinny_lm_head` is on and a measured config covers the shape (on CUDA, ``M <= 16``,
    nothing to differentiate: the engine's steps run with grad mode on but no tensor requiring
    grad; a first use builds its kernel, :func:`build_lm_head_ahead` does so at start-up), else
    ``F.linear``."""
    if (_skinny_lm_head(x.shape[0], weight) and x.is_cuda and skinny_gemm.can_use(x, weight)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return skinny_gemm.skinny_gemm(x, weight)
    return F.linear(x, weight)


def _skinny_lm_head(m: int, weight: torch.Tensor) -> bool:
    return (use_skinny_lm_head and use_skinny_gemm and m <= skinny_gemm.MAX_M
            and skinny_gemm.is_tuned(m, weight.shape[0], weight.shape[1]))


def build_lm_head_ahead(weight: torch.Tensor, int8: greedy_lm_head.Int8LmHead | None = None) -> int:
    """Build the skinny GEMM variants :func:`lm_head_linear` launches for 1..16 rows of this
    lm_head ``[V, H]``, and with ``int8`` (its copy) the launches of
    :func:`kernels.greedy_lm_head.greedy_tokens` for 1..16 rows, on a thread pool
    (:func:`kernels.precompile.launches_build_only`), so that a first batch size does not wait
    for them. Only a speed-up: an error is logged. -> the variants submitted (0 off CUDA or when
    none is tuned)."""
    if not weight.is_cuda or not skinny_gemm.is_available(weight.device):
        return 0
    try:
        with torch.inference_mode(), precompile.launches_build_only() as builds:
            for m in range(1, skinny_gemm.MAX_M + 1):
                x = weight.new_zeros(m, weight.shape[1])
                if _skinny_lm_head(m, weight):
                    skinny_gemm.skinny_gemm(x, weight)
                if int8 is not None and greedy_lm_head.can_use(x, weight, int8):
                    greedy_lm_head.greedy_tokens(x, weight, int8)
    except Exception as e:  # noqa: BLE001 - only a speed-up: the first launch still builds
        logger.warning("building the lm_head's GEMM kernels ahead failed (the first use builds "
                       "them): %s", e)
        return 0
    return builds.num_submitted


@dataclass
class ForwardContext:
    """What the layers of one forward need besides activations.

    kv_caches: per cache-layer ``(k_cache, v_cache)``, each ``[num_slots, num_kv_heads, head_dim]``.
    """

    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend
    # hybrid KV layout (engine/kv_cache.HybridLayout): the metadata of each sliding-window
    # group's block tables, and each cache layer's group (0: the full layers, ``meta``)
    swa_metas: tuple[AttentionMetadata, ...] = ()
    group_of_layer: tuple[int, ...] = ()

    def meta_of(self, cache_index: int) -> AttentionMetadata:
        """The metadata a cache layer reads and writes its K/V by (its group's slots)."""
        if not self.swa_metas:
            return self.meta
        return self.meta_of_group(self.group_of_layer[cache_index])

    def meta_of_group(self, group: int) -> AttentionMetadata:
        """The metadata of a group's block table (0: the full layers', ``meta``)."""
        return self.meta if group == 0 else self.swa_metas[group - 1]


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` over this rank's rows ``[rank * V / world_size, (rank + 1) * V /
    world_size)`` of the vocabulary; an id outside them contributes zeros, and one all-reduce
    sums the ranks' rows into the full embedding. One rank: ``nn.Embedding`` itself."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(tp.shard_size(vocab_size, "vocab_size"), hidden_size)
        self.tp = tp
        self.vocab_start = tp.rank * self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` int64 (full-vocabulary ids) -> ``[T, H]``."""
        if not self.tp.is_parallel:
            return fusion.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        is_here = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(is_here, local, 0), self.weight)
        return self.tp.all_reduce(rows * is_here.unsqueeze(-1).to(rows.dtype))


class RMSNorm(nn.Module):
    """``w * (x / sqrt(mean(x^2) + eps))``: statistics in fp32, cast back, then the plain weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fusion.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """GQA attention with QK-RMSNorm before RoPE, optional softplus output gate and sinks.

    With tensor parallelism (``tp``) a rank holds ``num_heads / world_size`` query heads and
    ``num_kv_heads / world_size`` KV heads (their Q|K|V|gate rows, gates and sinks: column
    parallel) and the matching ``o_proj`` columns (row parallel): its output is summed over the
    ranks by one all-reduce. ``num_heads`` etc. are the rank's counts.

    gating: ``None`` (no gate), ``"per-head"`` (``g_proj [nh, H]``, one gate per head broadcast
    over head_dim) or ``"per-element"`` (``g_proj [nh*hd, H]``). The gate reads the same normed
    input as Q/K/V and multiplies the attention output before ``o_proj``; softplus runs in fp32.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        *,
        cache_index: int,
        sliding_window: int | None = None,
        gating: str | None = None,
        has_sinks: bool = False,
        qkv_bias: bool = False,
        o_bias: bool = False,
        eps: float = 1e-6,
        is_causal: bool | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})"
            )
        self.tp = tp
        num_heads = tp.shard_size(num_heads, "num_attention_heads")
        num_kv_heads = tp.shard_size(num_kv_heads, "num_key_value_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=o_bias)
        self.gating = gating
        if gating is not None:
            gate_dim = num_heads if gating == "per-head" else self.q_size
            self.g_proj = nn.Linear(hidden_size, gate_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if has_sinks else None
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.cache_index = cache_index
        self.is_causal = is_causal  # None: the forward's default (causal targets, DFlash per config)
        self.scale = head_dim**-0.5

    # Fast path (inference, where the Triton kernels run; the eager bodies stay the reference):
    # Q/K norm + RoPE + K/V cache write in one kernel; Q|K|V|gate as one GEMM once fused.
    use_fused_qk_cache: bool = True
    qkvg_weight: torch.Tensor | None = None
    # In CUDA graphs of this many tokens up to 16 (decode, verify, the drafter block), Q|K|V|gate,
    # the Q/K norm + RoPE and the K/V write are one launch (kernels/qkv_norm_rope_cache.py: a
    # program a head, its first weight tile before the PDL wait, attention signalled early)
    # instead of the skinny GEMM and the Q/K kernel; None: never. On the H200 (XS-2.1, 1k
    # context) the decode graph replayed in 2.04-2.06 ms against 2.11-2.12, the 4-token verify
    # graph in 3.77-3.79 against 3.82-3.83 and the drafter block in 0.35 against 0.36 ms
    # (docs/PERFORMANCE.md, fifty-sixth pass).
    fuse_qk_min_tokens: int | None = 1
    # True: up to skinny_gemm.MAX_M tokens, ``o_proj.weight`` goes to the backend as an L2
    # prefetch hint (kernels/l2_prefetch.py). Off: on the H200 it did not pay (batch-1 replay
    # 2.29 ms with it, 2.26 without; an L2-resident o_proj weight saves its GEMM ~2.5 of ~15 us,
    # while issuing the prefetch costs the attention kernel ~2 us; docs/PERFORMANCE.md)
    prefetch_o_proj: bool = False

    def fuse_projections(self) -> None:
        """Inference: one GEMM for Q|K|V|gate. ``qkv_proj.weight`` and ``g_proj.weight`` become
        row views of ``qkvg_weight [q + 2kv + gate, H]`` (no copy kept; call after loading and
        after the last ``.to()``, since moving the module would split the views again)."""
        if self.gating is None or self.qkv_proj.bias is not None or self.qkvg_weight is not None:
            return
        n = self.qkv_proj.weight.shape[0]
        fused = torch.cat([self.qkv_proj.weight.detach(), self.g_proj.weight.detach()])
        self.qkv_proj.weight = nn.Parameter(fused[:n], requires_grad=False)
        self.g_proj.weight = nn.Parameter(fused[n:], requires_grad=False)
        self.qkvg_weight = fused

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [T, H]`` -> (``qkv [T, q + 2kv]``, gate logits ``[T, nh]`` / ``[T, nh, hd]`` or None)."""
        if self.qkvg_weight is not None:
            out = linear(x, self.qkvg_weight)
            n = self.q_size + 2 * self.kv_size
            qkv, gate = out[:, :n], out[:, n:]
        else:
            qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
            gate = linear(x, self.g_proj.weight, self.g_proj.bias) if self.gating is not None else None
        if gate is not None and self.gating != "per-head":
            gate = gate.view(x.shape[0], self.num_heads, self.head_dim)
        return qkv, gate

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [T, H]`` (already input-normed) -> ``[T, H]``; writes this forward's K/V."""
        t = x.shape[0]
        meta = ctx.meta_of(self.cache_index)
        positions = meta.positions
        k_cache, v_cache = ctx.kv_caches[self.cache_index]
        rot = self.rotary
        if self._head_gemm_runs(x, ctx):
            q, gate = qkv_norm_rope_cache.qkv_norm_rope_cache(
                x, self.qkvg_weight, self.num_heads, self.num_kv_heads, self.head_dim,
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rot.cos, rot.sin, positions,
                rot.spec.rotary_dim, meta.slot_mapping, k_cache, v_cache)
            if self.gating != "per-head":
                gate = gate.view(t, self.num_heads, self.head_dim)
            return self._attend_and_project(q, gate, k_cache, v_cache, ctx)
        qkv, gate = self.project(x)
        if self._fused_qk_cache_runs(qkv, ctx):
            q = qk_norm_rope_cache.qk_norm_rope_cache(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                self.k_norm.weight, self.q_norm.eps, rot.cos, rot.sin, positions,
                rot.spec.rotary_dim, meta.slot_mapping, k_cache, v_cache)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.norm_rope(self.q_norm, q.view(t, self.num_heads, self.head_dim), positions)
            k = self.norm_rope(self.k_norm, k.view(t, self.num_kv_heads, self.head_dim), positions)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            ctx.backend.write_kv(k_cache, v_cache, k, v, meta)
        return self._attend_and_project(q, gate, k_cache, v_cache, ctx)

    def _attend_and_project(self, q: torch.Tensor, gate: torch.Tensor | None, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # attention over the cache (this forward's K/V already written) and o_proj:
        # q [T, nh, hd] -> [T, H]
        t = q.shape[0]
        meta = ctx.meta_of(self.cache_index)
        # decode / verify / drafter-block sizes: o_proj streams its weight, which the attention
        # kernel may bring into L2 meanwhile (the HBM is idle during attention)
        prefetch = self.o_proj.weight if self.prefetch_o_proj and t <= skinny_gemm.MAX_M else None
        staged = (t == 1 and use_staged_o_proj and is_building_cuda_graph()
                  and not batch_invariant.is_active()
                  and self.o_proj.bias is None and not torch.is_grad_enabled()
                  and q.dtype == self.o_proj.weight.dtype and staged_gemv.supports(self.o_proj.weight))
        out = ctx.backend.attend(
            q, k_cache, v_cache, meta, scale=self.scale,
            sliding_window=self.sliding_window, sinks=self.sinks, is_causal=self.is_causal, gate=gate,
            prefetch=prefetch, early_signal=staged,  # the staged o_proj reads only its weight first
        )
        out = out.reshape(t, self.q_size)
        if staged and staged_gemv.can_use(out, self.o_proj.weight):
            return self.tp.all_reduce(staged_gemv.staged_gemv(out, self.o_proj.weight))
        return row_parallel_linear(out, self.o_proj, self.tp)

    def _head_gemm_runs(self, x: torch.Tensor, ctx: ForwardContext) -> bool:
        # The projection with the Q/K norm, RoPE and cache write in its epilogue: where the
        # skinny GEMM would take the projection (a CUDA-graph build of at most 16 tokens, the
        # fused Q|K|V|gate weight) and the Q/K kernel would follow it; not in batch-invariant mode
        # (its GEMMs keep one tile for every row count).
        return (
            self.fuse_qk_min_tokens is not None and use_skinny_gemm and self.qkvg_weight is not None
            and is_building_cuda_graph() and not batch_invariant.is_active()
            and self.fuse_qk_min_tokens <= x.shape[0] <= qkv_norm_rope_cache.MAX_M
            and self._fused_qk_cache_runs(x, ctx)
            and qkv_norm_rope_cache.can_use(x, self.qkvg_weight, self.head_dim)
        )

    def _fused_qk_cache_runs(self, qkv: torch.Tensor, ctx: ForwardContext) -> bool:
        # Only where the backend stores K/V the standard way (training backends keep them
        # instead) and nothing needs gradients.
        return (
            self.use_fused_qk_cache
            and not torch.is_grad_enabled()
            and type(ctx.backend).write_kv is AttentionBackend.write_kv
            and qk_norm_rope_cache.is_available(qkv.device)
        )

    def norm_rope(self, norm: RMSNorm, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm then RoPE of ``x [T, heads, head_dim]`` (one fused kernel on CUDA)."""
        rot = self.rotary
        return fusion.rms_norm_rope(x, norm.weight, norm.eps, rot.cos, rot.sin, positions,
                                    rot.spec.rotary_dim)


def row_parallel_linear(x: torch.Tensor, layer: nn.Linear, tp: TensorParallel,
                        reduce_results: bool = True) -> torch.Tensor:
    """``x [M, K / world_size] @ layer.weight [N, K / world_size]^T``, summed over the ranks
    (with ``reduce_results``), plus the bias once -> ``[M, N]``. One rank: :func:`linear`."""
    scale = getattr(layer, "weight_scale", None)  # an fp8 layer (models/fp8.py)
    if not tp.is_parallel:
        return linear(x, layer.weight, layer.bias, scale)
    out = linear(x, layer.weight, scale=scale)
    if reduce_results:
        out = tp.all_reduce(out)
    return out if layer.bias is None else out + layer.bias


class MLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` with fused ``gate_up_proj [2I, H]`` (gate rows first).

    With tensor parallelism a rank holds ``I / world_size`` of the width (``intermediate_size``
    is the rank's): gate|up column parallel, down row parallel, summed over the ranks unless
    ``reduce_results`` is False (the MoE's shared expert: the MoE reduces its whole output)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, reduce_results: bool = True,
                 size_field: str = "intermediate_size") -> None:
        super().__init__()
        self.tp, self.reduce_results = tp, reduce_results
        # size_field: the config field an indivisible width is reported under
        self.intermediate_size = intermediate_size = tp.shard_size(intermediate_size, size_field)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        h = gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias,
                         getattr(self.gate_up_proj, "weight_scale", None),
                         getattr(self.gate_up_proj, "weight_unquantized", None))
        return row_parallel_linear(h, self.down_proj, self.tp, self.reduce_results)


class MoE(nn.Module):
    """Laguna MoE: router scores, biased top-k selection, renormalised weights, shared expert.

    ``s = sigmoid(z)`` (or ``sqrt(softplus(z))``) with ``z = softcap(x Wr^T)`` in fp32; experts are
    chosen by ``topk(s + e_score_correction_bias)`` but weighted by the UNBIASED ``s``,
    renormalised over the top-k; ``y = scale * sum_j w_j expert_j(x) + shared(x)`` (shared not
    scaled).

    With tensor parallelism every rank routes (the router is replicated) and holds
    ``moe_intermediate_size / world_size`` of every expert's width (and of the shared expert's):
    its ``y`` is a partial sum, reduced over the ranks by one all-reduce. With expert parallelism
    (``tp.expert_parallel``) a rank instead holds ``num_experts / world_size`` whole experts,
    global ids ``first_expert ..``; the pairs routed to other ranks' experts contribute nothing
    here (local id -1, "skipped"), and the same all-reduce adds them in from their ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_intermediate_size: int,
        *,
        routed_scaling_factor: float = 1.0,
        logit_softcapping: float = 0.0,
        score_func: str = "sigmoid",
        norm_topk_prob: bool = True,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if score_func not in ("sigmoid", "sqrtsoftplus"):
            raise ValueError(
                f"moe_router_score_func={score_func!r} is not supported; use sigmoid or sqrtsoftplus"
            )
        self.tp = tp
        self.first_expert, self.num_local_experts = tp.expert_shard(num_experts)
        if not tp.shards_experts:
            moe_intermediate_size = tp.shard_size(moe_intermediate_size, "moe_intermediate_size")
        self.num_experts, self.top_k = num_experts, top_k
        self.intermediate_size = moe_intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        n = self.num_local_experts
        self.experts_gate_up = nn.Parameter(torch.empty(n, 2 * moe_intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(n, hidden_size, moe_intermediate_size))
        self.shared_expert = (
            MLP(hidden_size, shared_intermediate_size, tp=tp, reduce_results=False,
                size_field="shared_expert_intermediate_size")
            if shared_intermediate_size > 0 else None
        )
        self.routed_scaling_factor = routed_scaling_factor
        self.logit_softcapping = logit_softcapping
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (weights ``[T, k]`` in x's dtype, expert ids ``[T, k]`` int64)."""
        return fusion.moe_route(linear(x, self.gate.weight), self.e_score_correction_bias,
                                self.top_k, self.logit_softcapping, self.score_func,
                                self.norm_topk_prob)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids ``[T, k]`` -> this rank's: ``id - first_expert`` for its experts,
        -1 for pairs routed to another rank's (expert parallelism; else ``ids`` unchanged)."""
        if not self.tp.shards_experts:
            return ids
        local = ids - self.first_expert
        return local.masked_fill((local < 0) | (local >= self.num_local_experts), -1)

    # Expert paths, chosen from shapes only (so a CUDA graph captures one of them):
    # * GPU, up to ``fused_moe_max_pairs`` (token, expert) pairs: routing in one Triton kernel
    #   (kernels/moe_routing.py; with the router GEMM in the same launch for few tokens) and the fused
    #   expert kernels (kernels/fused_moe.py: each hit expert's weights read once, no host sync,
    #   static grid; measured in docs/PERFORMANCE.md),
    #   with the shared expert as one more always-on pair once :meth:`fold_shared_expert` ran.
    #   ``use_fused_moe=False`` turns them off.
    # * GPU, more pairs: the same routing, then the sorted Triton kernels (kernels/grouped_moe.py,
    #   sync-free), their tile rows from the token count (:func:`grouped_moe.block_m_for`). On the
    #   H200 at XS-2.1 shapes (9 pairs a token) they took 0.59-0.75x the time of one sorted
    #   ``torch._grouped_mm`` pair from 32 to 16384 tokens (batch-64 decode 409 against 572 us a
    #   layer; docs/PERFORMANCE.md, forty-first pass). The fused kernels' in-program grouping is
    #   O(P) a program: past ``fused_moe_max_pairs`` it loses to the sorted ones.
    # * GPU without the Triton kernels, half precision on sm90+: the grouped GEMM pair
    #   (:meth:`experts_forward_grouped`, sync-free); also past ``grouped_mm_min_pairs`` pairs
    #   when that is set (the A/B switch; None: never).
    # * otherwise (CPU, training): the reference loop over the experts hit (one host sync).
    use_fused_moe: bool = True
    fused_moe_max_pairs: int = 256
    grouped_mm_min_pairs: int | None = None
    # Up to ``moe_gemv_max_tokens`` tokens (decode at batch <= 4, batch-1 verify of K <= 3): the
    # per-pair GEMV kernels (kernels/moe_gemv.py) instead of the grouped fused kernels. Few pairs
    # share an expert there; on the H200 they take 19.8 / 36.4 / 57.3 us per layer at T = 1 / 2 /
    # 4 against 30.5 / 45.9 / 71.4 (bench_fused_moe.py, XS-2.1 shapes; larger T not measured).
    use_moe_gemv: bool = True
    moe_gemv_max_tokens: int = 4
    # Up to ``fused_router_max_tokens`` tokens (at most kernels/moe_routing.MAX_ROUTER_TOKENS = 16)
    # and a bias-free router: the router GEMM and the routing in ONE launch
    # (moe_routing.fused_router_route) instead of the router GEMM (linear) then the routing
    # kernel: one kernel boundary less per sparse layer. Its last program routes every token
    # alone, so it pays only for a few tokens: on the H200 (benchmarks/bench_router_route.py,
    # E = 256, H = 2048) 4.3 / 4.8 / 5.4 / 5.6 us per layer at T = 1 / 2 / 3 / 4 against 5.1 /
    # 5.8 / 5.8 / 5.8 for the skinny GEMM + routing kernel, but 7.1 against 5.9 at T = 8.
    # False: the two-launch path everywhere (the A/B baseline).
    use_fused_router: bool = True
    fused_router_max_tokens: int = 4
    # > 0: up to ``prefetch_next_max_tokens`` tokens, the fused router's programs prefetch this
    # many bytes of :attr:`prefetch_next` (the next layer's Q|K|V|gate weight,
    # :func:`link_next_weights`) into L2 after their arrival at its semaphore
    # (moe_routing.PREFETCH_AT), while the routing and the hand-off to the expert GEMVs leave the
    # HBM idle; the GEMVs stream with ``evict_first``, so the bytes are still in L2 when the next
    # layer's head GEMM reads them. A contiguous tail (``prefetch_next_from_end``) or head, or
    # the end of every row (``prefetch_next_rows``). On an H100 the decode graph replayed in
    # 2.36-2.38 against 2.42 ms with 8 to 24 MB of a tail or a head; the end of every row and a
    # prefetch before the router's PDL wait or just after it gained little or nothing, since the
    # router's own span grew by about what the head GEMM's fell (docs/PERFORMANCE.md,
    # seventy-eighth pass). In goal 2's cell (benchmarks/gpu_check.sh pass139) the target-only
    # decode step took 2.53 against 2.58 ms; prefetching in the verify too (up to 4 tokens) made
    # the DFlash K = 3 step 5.27-5.29 against 5.32-5.33 ms (pass138's stage, decode only
    # prefetching). 0: off (the A/B baseline).
    prefetch_next_bytes: int = 16 << 20
    prefetch_next_max_tokens: int = 4
    prefetch_next_rows: bool = False
    prefetch_next_from_end: bool = True
    prefetch_next: torch.Tensor | None = None
    # [E + 1, 2I, H] / [E + 1, H, I]: the routed experts then the shared expert (fold_shared_expert)
    gate_up_with_shared: torch.Tensor | None = None
    down_with_shared: torch.Tensor | None = None

    def fold_shared_expert(self) -> None:
        """Inference: stack the shared expert after the routed ones (when its width matches,
        as in every Laguna, and the routed experts are not split by expert) so the fused
        kernels run it as pair ``E`` with weight 1, instead of three more GEMV/activation
        kernels. The expert and shared parameters become views of
        the stacked tensors (no copy kept; call after loading and the last ``.to()``)."""
        shared = self.shared_expert
        # expert parallelism: the fused kernels' pair id E would be another rank's expert
        # (local_ids: -1) on every rank, and the shared expert would be dropped
        if (shared is None or self.tp.shards_experts
                or shared.intermediate_size != self.intermediate_size
                or shared.gate_up_proj.bias is not None or self.gate_up_with_shared is not None):
            return
        e = self.num_local_experts
        gate_up = torch.cat([self.experts_gate_up.detach(), shared.gate_up_proj.weight.detach()[None]])
        down = torch.cat([self.experts_down.detach(), shared.down_proj.weight.detach()[None]])
        self.experts_gate_up = nn.Parameter(gate_up[:e], requires_grad=False)
        self.experts_down = nn.Parameter(down[:e], requires_grad=False)
        shared.gate_up_proj.weight = nn.Parameter(gate_up[e], requires_grad=False)
        shared.down_proj.weight = nn.Parameter(down[e], requires_grad=False)
        self.gate_up_with_shared, self.down_with_shared = gate_up, down

    def _fused_kernels_run(self, x: torch.Tensor) -> bool:
        if batch_invariant.is_active():  # the engine checked that the kernels run here
            return not self.training and not torch.is_grad_enabled()
        if not (x.is_cuda and self.use_fused_moe and not self.training
                and not torch.is_grad_enabled() and fused_moe.is_available(x.device)):
            return False
        num_pairs = x.shape[0] * (self.top_k + (self.gate_up_with_shared is not None))
        # the Triton kernels take every size (the sorted ones past fused_moe_max_pairs), unless
        # the A/B switch sends large ones to the grouped GEMM where it runs
        return (self.grouped_mm_min_pairs is None or num_pairs < self.grouped_mm_min_pairs
                or not grouped_mm_available(x))

    def fused_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(gate_up, down)`` the Triton expert kernels run: the stacked ``[E + 1, ...]``
        tensors once :meth:`fold_shared_expert` ran (the shared expert as pair ``E``), else the
        routed experts."""
        if self.gate_up_with_shared is not None:
            return self.gate_up_with_shared, self.down_with_shared
        return self.experts_gate_up, self.experts_down

    def launch_sorted_kernels_at_every_tile_height(self) -> None:
        """Launch the sorted expert kernels (:meth:`fused_forward` past ``fused_moe_max_pairs``)
        once at each tile height of :func:`grouped_moe.engine_block_ms`, with this layer's
        experts, dtype and switches and one token routed to its first ``k`` experts. Meant for
        :func:`kernels.precompile.launches_build_only`, where each launch only builds its
        variant: the variants differ by those, not by the token count, so a first long forward
        (an eager prefill past the prefill graphs, or with no graphs) then builds none."""
        gate_up, down = self.fused_experts()
        k = min(self.top_k + (self.gate_up_with_shared is not None), gate_up.shape[0])
        x = gate_up.new_zeros(1, gate_up.shape[-1])
        ids = torch.arange(k, device=x.device)[None]  # distinct, in range: align_pairs runs
        skips = {"has_skipped_pairs": True} if self.tp.shards_experts else {}
        for block_m in grouped_moe.engine_block_ms():
            grouped_moe.sorted_moe_experts(x, ids, x.new_ones(1, k), gate_up, down,
                                           block_m=block_m, **skips)

    def forward(self, x: torch.Tensor, keep_pairs: bool = False) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``. ``keep_pairs``: the fused path may return its pairs
        ``[T, P, H]`` unsummed (each already weighted; the caller sums them with the residual
        add, :func:`fusion.add_rms_norm`); never with tensor parallelism, where the rank's sum
        is all-reduced."""
        if self.tp.is_parallel:
            return self.tp.all_reduce(self._forward(x, keep_pairs=False))
        return self._forward(x, keep_pairs)

    def _forward(self, x: torch.Tensor, keep_pairs: bool) -> torch.Tensor:
        if self._fused_kernels_run(x):
            return self.fused_forward(x, keep_pairs)
        weights, ids = self.route(x)
        if self.training:
            self.last_expert_ids = ids.detach()  # read by the trainer's load balancing
        ids = self.local_ids(ids)
        if x.is_cuda and not self.training and grouped_mm_available(x):
            routed = self.experts_forward_grouped(x, weights, ids)
        elif x.is_cuda and ids.numel() <= self.num_local_experts:
            routed = self.experts_forward_gather(x, weights, ids)
        else:
            routed = self.experts_forward(x, weights, ids)
        if self.shared_expert is None:
            out = routed * self.routed_scaling_factor
        else:
            out = fusion.scale_add(routed, self.routed_scaling_factor, self.shared_expert(x))
        return out

    _region_cache: tuple | None = None

    def _next_weight_region(self) -> torch.Tensor | l2_prefetch.Spread | None:
        """What :attr:`prefetch_next_bytes` and its switches say to prefetch of
        :attr:`prefetch_next`, or None; kept until a switch or the weight changes (a few us of
        host work a layer otherwise, on the eager path)."""
        if self.prefetch_next is None or self.prefetch_next_bytes <= 0:
            return None
        key = (self.prefetch_next_bytes, self.prefetch_next_rows, self.prefetch_next_from_end)
        cached = self._region_cache
        if cached is None or cached[0] != key or cached[1] is not self.prefetch_next:
            region = (l2_prefetch.row_suffixes(self.prefetch_next, self.prefetch_next_bytes)
                      if self.prefetch_next_rows else
                      l2_prefetch.region(self.prefetch_next, self.prefetch_next_bytes,
                                         self.prefetch_next_from_end))
            cached = self._region_cache = (key, self.prefetch_next, region)
        return cached[2]

    def fused_forward(self, x: torch.Tensor, keep_pairs: bool = False) -> torch.Tensor:
        """The GPU small-batch path: router GEMM and routing (weights already times the routed
        scaling factor; one launch with :attr:`use_fused_router`), the two fused expert kernels
        over all pairs (the shared expert included once folded); the pairs ``[T, P, H]`` when
        ``keep_pairs`` and folded, else their sum ``[T, H]``."""
        folded = self.gate_up_with_shared is not None
        route = (self.e_score_correction_bias, self.top_k, self.logit_softcapping, self.score_func,
                 self.norm_topk_prob)
        invariant = batch_invariant.is_active()  # per-token paths only (no GEMV variants)
        if (self.use_fused_router and not invariant and x.shape[0] <= self.fused_router_max_tokens
                and self.gate.bias is None and moe_routing.can_fuse_router(x, self.gate.weight)):
            prefetch = self._next_weight_region() if x.shape[0] <= self.prefetch_next_max_tokens else None
            weights, ids = moe_routing.fused_router_route(
                x, self.gate.weight, *route, scale=self.routed_scaling_factor, num_shared=int(folded),
                prefetch=prefetch)
        else:
            weights, ids = moe_routing.fused_moe_route(
                linear(x, self.gate.weight), *route, scale=self.routed_scaling_factor,
                num_shared=int(folded))
        # expert parallelism: the kernels skip (output 0, no weight read) the pairs of id -1
        skips = {"has_skipped_pairs": True} if self.tp.shards_experts else {}
        experts = (x, self.local_ids(ids), weights, *self.fused_experts())
        if invariant:
            pairs = batch_invariant.moe_experts(*experts, **skips)
        elif self.use_moe_gemv and x.shape[0] <= self.moe_gemv_max_tokens:
            pairs = moe_gemv.moe_gemv_experts(*experts, **skips)
        elif ids.numel() > self.fused_moe_max_pairs:
            pairs = grouped_moe.sorted_moe_experts(
                *experts, block_m=grouped_moe.block_m_for(x.shape[0]), **skips)
        else:
            pairs = fused_moe.fused_moe_experts(*experts, reduce=False, **skips)
        if folded and keep_pairs:
            return pairs
        if not folded and self.shared_expert is not None:
            return fusion.add(self.shared_expert(x), pairs)
        return fusion.add(pairs[:, 0], pairs[:, 1:])

    def experts_forward_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Sync-free grouped GEMM over the experts hit, any token count: ``[T, H]``.

        The ``T*k`` pairs are sorted by expert; ``offs[e]`` (int32, on the device) is the end of
        expert ``e``'s rows, so ``torch._grouped_mm`` multiplies rows ``offs[e-1]:offs[e]`` by
        expert ``e`` (empty groups read nothing). Results go back to pair order and are summed
        over ``k`` in a fixed order (deterministic, unlike an atomic scatter-add). Skipped pairs
        (id -1, expert parallelism) sort last, past ``offs[-1]``: ``_grouped_mm`` leaves their
        rows unwritten (garbage), so they are replaced by 0 before the sum.
        """
        t, k = ids.shape
        n = self.num_local_experts
        flat = ids.reshape(-1)
        skips = self.tp.shards_experts  # only then can ids hold -1 (no extra ops otherwise)
        skipped = flat < 0 if skips else None
        key = flat.masked_fill(skipped, n) if skips else flat  # skipped pairs: group n, last
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(n + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, key, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts[:n], 0, dtype=torch.int32)
        h = x[order // k]
        gate, up = torch._grouped_mm(h, self.experts_gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.experts_down.transpose(1, 2), offs=offs)
        pairs = torch.empty_like(y)
        pairs[order] = y
        if skips:
            pairs = pairs.masked_fill(skipped[:, None], 0)
        return (pairs.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def experts_forward_gather(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Sync-free path for few tokens: gather each pair's expert weights and batch-matmul.

        ``[T, H]``; reads ``T*k`` expert matrices, so it is only used for small ``T*k``.
        A skipped pair (id -1) reads expert 0 and its product is replaced by 0.
        """
        t, k = ids.shape
        flat = ids.reshape(-1)
        h = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        skips = self.tp.shards_experts  # only then can ids hold -1 (no extra ops otherwise)
        gathered = flat.clamp(min=0) if skips else flat
        gate, up = torch.bmm(self.experts_gate_up[gathered], h).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(self.experts_down[gathered], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        if skips:
            out = out.masked_fill((flat < 0)[:, None], 0)
        return (out.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def experts_forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Reference grouped expert loop over the experts actually hit: ``[T, H]``.

        Sorts the ``T*k`` assignments by expert and runs one SwiGLU GEMM pair per hit expert.
        (One host sync for the per-expert counts; the GPU fused-MoE path replaces this.)
        Skipped pairs (id -1, expert parallelism) sort last and are never visited.
        """
        t, k = ids.shape
        n = self.num_local_experts
        flat_ids = ids.reshape(-1).masked_fill(ids.reshape(-1) < 0, n)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // k
        counts = torch.bincount(flat_ids, minlength=n + 1)[:n].tolist()
        out = torch.zeros_like(x)
        start = 0
        w_sorted = weights.reshape(-1)[order]
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            h = x[rows]
            gate, up = F.linear(h, self.experts_gate_up[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.experts_down[expert])
            out.index_add_(0, rows, (h * w_sorted[start : start + count, None]).to(out.dtype))
            start += count
        return out


def build_sorted_moe_kernels_ahead(model: nn.Module) -> int:
    """Build the sorted MoE kernels of every tile height for each distinct expert layout of
    ``model``'s MoE layers on CUDA (:meth:`MoE.launch_sorted_kernels_at_every_tile_height`), on
    the precompile pool. Only a speed-up: an error is logged, and the first long forward
    builds what is missing. -> the variants submitted (0 when all were built or loaded)."""
    layouts = {}
    for module in model.modules():
        if (isinstance(module, MoE) and module.experts_gate_up.is_cuda and module.use_fused_moe
                and grouped_moe.is_available(module.experts_gate_up.device)):
            gate_up = module.fused_experts()[0]
            key = (tuple(gate_up.shape), gate_up.dtype, module.top_k, module.tp.shards_experts)
            layouts.setdefault(key, module)
    if not layouts:
        return 0
    try:
        with torch.inference_mode(), precompile.launches_build_only() as builds:
            for module in layouts.values():
                module.launch_sorted_kernels_at_every_tile_height()
    except Exception as e:  # noqa: BLE001 - only a speed-up: the launches still build
        logger.warning("building the sorted MoE kernels ahead failed (the first long forward "
                       "builds them): %s", e)
        return 0
    return builds.num_submitted


def grouped_mm_available(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs for ``x``: a half-precision CUDA tensor on sm90+."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def fuse_for_inference(model: nn.Module) -> None:
    """Re-lay a loaded model's weights for the GPU fast path, values unchanged: Q|K|V|gate as
    one GEMM (:meth:`Attention.fuse_projections`), the shared expert stacked after the routed
    ones (:meth:`MoE.fold_shared_expert`). Inference only (the new views need no gradient).

    On CUDA the allocator's cache is emptied after each module: the replaced tensors' segments
    go back to the device before the next module's new tensors are allocated. Kept cached, a
    later smaller tensor splits a freed segment (a layer's stacked down experts, half the size of
    the gate_up ones, land in the previous layer's freed gate_up segment) and the rest of the
    segment stays reserved: memory counted in use when the KV cache is sized (17.7 GiB at
    XS-2.1 size on the H200, docs/PERFORMANCE.md, thirty-ninth pass)."""
    is_cuda = any(p.is_cuda for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Attention):
            module.fuse_projections()
        elif isinstance(module, MoE):
            module.fold_shared_expert()
        else:
            continue
        if is_cuda:
            torch.cuda.empty_cache()
    link_next_weights(model)


def link_next_weights(model: nn.Module) -> None:
    """Point each sparse layer's MoE at the next layer's Q|K|V|gate weight (``prefetch_next``),
    within each list of decoder layers of ``model``; the last layer's gets ``None``. Call after
    :func:`fuse_for_inference` (the fused weight is the one the next GEMM reads)."""
    for module in model.modules():
        if not isinstance(module, nn.ModuleList):
            continue
        decoder_layers = [m for m in module if isinstance(m, DecoderLayer)]
        for i, layer in enumerate(decoder_layers):
            if not isinstance(layer.mlp, MoE):
                continue
            weight = None
            if i + 1 < len(decoder_layers):
                attn = decoder_layers[i + 1].self_attn
                # a plain tensor view (not a Parameter: the module would register it as its own)
                weight = (attn.qkvg_weight if attn.qkvg_weight is not None else attn.qkv_proj.weight).detach()
            layer.mlp.prefetch_next = weight


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``.

    :meth:`forward_deferred` leaves the last add to the caller, who fuses it into the next
    layer's input norm (or the final norm): one kernel less per layer, and the MoE pairs' sum
    rides along (:func:`run_layers`)."""

    def __init__(self, attn: Attention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``h [T, H]`` -> the layer's output ``[T, H]``."""
        residual, delta = self.forward_deferred(h, None, ctx)
        return fusion.add(residual, delta)

    def forward_deferred(self, residual: torch.Tensor, delta: torch.Tensor | None,
                         ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on input ``residual + delta`` (``delta`` None: ``residual`` alone; else
        ``[T, H]`` or MoE pairs ``[T, P, H]``) -> ``(residual, delta)`` whose sum is its output."""
        return self.forward_normed(*self.add_input_norm(residual, delta), ctx)

    def add_input_norm(self, residual: torch.Tensor,
                       delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + delta, input_layernorm(residual + delta))``, ``[T, H]`` each, in one
        kernel; the sum is the previous layer's output (``delta`` None: ``residual`` is)."""
        norm = self.input_layernorm
        if delta is None:
            return residual, norm(residual)
        return fusion.add_rms_norm(residual, delta, norm.weight, norm.eps)

    def forward_normed(self, residual: torch.Tensor, x: torch.Tensor,
                       ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its input norm: ``residual`` its input, ``x`` the normed input ->
        ``(residual, delta)`` whose sum is its output (:meth:`forward_deferred`)."""
        norm = self.post_attention_layernorm
        residual, x = fusion.add_rms_norm(residual, self.self_attn(x, ctx), norm.weight, norm.eps)
        delta = self.mlp(x, keep_pairs=True) if isinstance(self.mlp, MoE) else self.mlp(x)
        return residual, delta


def run_layers(layers: nn.ModuleList, h: torch.Tensor, ctx: ForwardContext, final_norm: RMSNorm,
               tap_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``h [T, H]`` through ``layers`` then ``final_norm`` -> (normed ``[T, H]``, taps): tap
    ``i`` is layer ``i``'s output ``[T, H]``. Each layer's residual add runs fused with the next
    norm (:meth:`DecoderLayer.add_input_norm`, or the final norm), and a tap is the sum that
    kernel writes anyway: a forward with taps runs the same kernels, with the same values, as
    one without."""
    residual, delta = h, None
    taps: dict[int, torch.Tensor] = {}
    wanted = set(tap_layer_ids)
    for i, layer in enumerate(layers):
        residual, x = layer.add_input_norm(residual, delta)
        if i - 1 in wanted:  # residual is layer i - 1's output
            taps[i - 1] = residual
        residual, delta = layer.forward_normed(residual, x, ctx)
    if delta is None:  # no layers
        normed = final_norm(residual)
    else:
        residual, normed = fusion.add_rms_norm(residual, delta, final_norm.weight, final_norm.eps)
    if len(layers) - 1 in wanted:
        taps[len(layers) - 1] = residual
    return normed, taps
