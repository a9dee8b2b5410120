"""DFlash drafter base class, Qwen3 flavour (z-lab ``DFlashDraftModel`` semantics).

The drafter fills a block ``[bonus, MASK x K]`` in one forward. It never sees context tokens:
target taps ``[N, n_taps * H_t]`` are fused by ``fc`` into context rows that serve only as extra
K/V in every drafter layer (reference/dflash.md section 1). Embeddings and lm_head are the
target's own tensors (shared storage, never copied).

Context K/V precompute is split into three hooks so a flavour overrides only what differs:
``_build_context_kv_buffers`` (stack every layer's K/V rows and K-norm weights after loading),
``_project_context_kv`` (ONE GEMM for all layers), ``_normalize_context_k`` (one grouped
K-RMSNorm); then one RoPE over all layers' K and the cache writes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import SINGLE, TensorParallel
from ..kernels import context_kv as context_kv_kernels
from ..kernels.argmax import argmax_rows
from .config_utils import ConfigReader
from .decoder import Group, attention_groups, build_rotaries, mlp_groups
from .draft_vocab import restrict_rows
from .fp8 import fp8_linear
from .fusion import rms_norm_grouped
from .layers import (
    MLP,
    Attention,
    DecoderLayer,
    ForwardContext,
    RMSNorm,
    linear,
    lm_head_linear,
    run_layers,
)
from .qwen3 import qwen3_rope
from .rope import RopeSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftLayerSpec:
    sliding_window: int | None
    is_causal: bool
    gating: str | None = None
    has_sinks: bool = False


@dataclass(frozen=True)
class DraftSpec:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope: RopeSpec
    layers: tuple[DraftLayerSpec, ...]
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    input_embedding_scale: float = 1.0


def dflash_value(cfg: dict, name: str, default=None):
    """``dflash_config[name]`` with the top-level field as fallback (as the references read it)."""
    dcfg = cfg.get("dflash_config") or {}
    if name in dcfg and dcfg[name] is not None:
        return dcfg[name]
    return cfg.get(name, default)


def dflash_int(cfg: dict, name: str, arch: str, default: int, minimum: int = 0) -> int:
    """:func:`dflash_value` ``name`` as an integer of at least ``minimum`` (``default`` when
    absent); any other value is an error naming the field."""
    value = dflash_value(cfg, name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arch}: config.json field dflash_config.{name} must be an integer >= "
                         f"{minimum}, got {value!r}")
    return value


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's default taps: evenly from layer 1 to L-3 (``[L // 2]`` for a single tap)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


def _eagle_aux_ids(cfg: dict, arch: str) -> list[int] | None:
    """``eagle_aux_hidden_state_layer_ids`` (vLLM's tap ids: id ``k`` is the output of layer
    ``k - 1``, id 0 the embeddings), checked; ``None`` when absent."""
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        return None
    if not isinstance(aux, list) or any(isinstance(a, bool) or not isinstance(a, int) for a in aux):
        raise ValueError(f"{arch}: config.json field 'eagle_aux_hidden_state_layer_ids' must be a list "
                         f"of layer ids (ints), got {aux!r}")
    if any(a < 1 for a in aux):
        raise ValueError(
            f"{arch}: config.json field 'eagle_aux_hidden_state_layer_ids' {aux} holds id 0 (the "
            "embedding output), which a DFlash drafter does not tap; ids are target layer index + 1"
        )
    return list(aux)


def resolve_target_layer_ids(cfg: dict, arch: str) -> list[int] | None:
    """The tapped target layers (0-based; tap ``t`` is the output of layer ``t``):
    ``dflash_config.target_layer_ids`` (or the top-level field), else vLLM's
    ``eagle_aux_hidden_state_layer_ids`` minus one; ``None`` when the config names neither."""
    taps = dflash_value(cfg, "target_layer_ids")
    if taps is not None:
        if not isinstance(taps, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in taps):
            raise ValueError(f"{arch}: config.json field dflash_config.target_layer_ids must be a list "
                             f"of target layer ids (ints), got {taps!r}")
        return list(taps)
    aux = _eagle_aux_ids(cfg, arch)
    return None if aux is None else [a - 1 for a in aux]


def check_target_compat(cfg: dict, target: nn.Module | None, taps: list[int], arch: str) -> None:
    """Drafter/target consistency: taps inside the target's depth, and the same taps as
    ``eagle_aux_hidden_state_layer_ids`` (which vLLM reads first) when the config has both."""
    if not taps:
        raise ValueError(f"{arch}: dflash_config.target_layer_ids is empty; list the tapped target layers")
    if target is not None:
        width = target.spec.hidden_size
        # the block is embedded with the target's embed_tokens and drafted through its lm_head,
        # and fc reads the target's hidden states: a drafter for another target fails only at
        # its first step (a shape error naming neither model)
        for key in ("hidden_size", "target_hidden_size"):
            value = cfg.get(key)
            if value is not None and value != width:
                raise ValueError(
                    f"{arch}: config.json {key} {value} differs from the target's hidden_size {width}; "
                    "a DFlash drafter shares the target's embeddings and lm_head and reads its hidden "
                    "states: pair it with the target it was trained for")
        depth = target.spec.num_layers
        bad = [t for t in taps if not 0 <= t < depth]
        if bad:
            raise ValueError(
                f"{arch}: dflash_config.target_layer_ids {bad} reference layers that do not exist in "
                f"a {depth}-layer target; use ids in [0, {depth})"
            )
        trained = dflash_value(cfg, "num_target_layers")
        if isinstance(trained, int) and trained != depth:  # lossless still; drafts may be poor
            logger.warning("%s: the drafter was trained against a %d-layer target "
                           "(num_target_layers) and is paired with a %d-layer one: pair it with "
                           "the target it was trained for", arch, trained, depth)
    aux = _eagle_aux_ids(cfg, arch)
    if aux is not None and aux != [t + 1 for t in taps]:
        raise ValueError(
            f"{arch}: config.json field 'eagle_aux_hidden_state_layer_ids' {aux} and "
            f"dflash_config.target_layer_ids {list(taps)} name different target layers (vLLM taps "
            f"the first, SGLang the second); the eagle ids must be each target layer id + 1, i.e. "
            f"{[t + 1 for t in taps]}: fix one of them or remove eagle_aux_hidden_state_layer_ids"
        )


def resolve_qwen3_draft_layers(cfg: dict, num_layers: int,
                               arch: str = "DFlashDraftModel") -> tuple[DraftLayerSpec, ...]:
    """Per-layer window and causality (vLLM's ``_resolve_layer_attention``).

    ``layer_types``: sliding layers are windowed and causal, full layers bidirectional;
    ``use_swa`` without ``layer_types``: every layer windowed and bidirectional; else all
    bidirectional. ``is_causal`` / ``dflash_config.causal`` override causality for all layers.
    """
    dcfg = cfg.get("dflash_config") or {}
    window = dcfg.get("swa_window_size") or cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        ConfigReader(cfg, arch).check_len("layer_types", layer_types, num_layers)
    override = cfg.get("is_causal")
    if override is None:
        override = dcfg.get("causal")
    specs = []
    for i in range(num_layers):
        if layer_types:
            sliding = layer_types[i] == "sliding_attention"
            causal = sliding
        else:
            sliding = bool(cfg.get("use_swa") or dcfg.get("use_swa"))
            causal = False
        if override is not None:
            causal = bool(override)
        if sliding and not window:
            raise ValueError("drafter has sliding layers but no sliding_window / swa_window_size; set one")
        specs.append(DraftLayerSpec(int(window) if sliding else None, causal))
    return tuple(specs)


def qwen3_draft_spec(cfg: dict, target: nn.Module | None, arch: str = "DFlashDraftModel") -> DraftSpec:
    r = ConfigReader(cfg, arch)
    num_layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")
    num_heads = r.int("num_attention_heads")
    head_dim = r.int("head_dim", hidden // num_heads)
    num_target_layers = cfg.get("num_target_layers") or dflash_value(cfg, "num_target_layers")
    taps = resolve_target_layer_ids(cfg, arch)
    if taps is None:
        if not num_target_layers:
            raise ValueError(f"{arch}: config needs dflash_config.target_layer_ids (or num_target_layers)")
        taps = default_target_layer_ids(int(num_target_layers), num_layers)
    check_target_compat(cfg, target, list(taps), arch)
    mask_id = dflash_value(cfg, "mask_token_id")
    if mask_id is None:
        raise ValueError(f"{arch}: config needs dflash_config.mask_token_id (the MASK row of the target vocab)")
    rope = RopeSpec.from_dict(qwen3_rope(cfg), head_dim, r.int("max_position_embeddings", 40960))
    layers = resolve_qwen3_draft_layers(cfg, num_layers, arch)
    if dflash_value(cfg, "attention_sink_bias"):
        layers = tuple(DraftLayerSpec(s.sliding_window, s.is_causal, s.gating, True) for s in layers)
    return DraftSpec(
        hidden_size=hidden,
        target_hidden_size=r.int("target_hidden_size", target.spec.hidden_size if target is not None else hidden),
        num_heads=num_heads, num_kv_heads=r.int("num_key_value_heads", num_heads), head_dim=head_dim,
        intermediate_size=r.int("intermediate_size"), rope=rope, layers=layers,
        target_layer_ids=tuple(int(t) for t in taps), block_size=dflash_int(cfg, "block_size", arch, 16, 2),
        mask_token_id=dflash_int(cfg, "mask_token_id", arch, 0), rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        input_embedding_scale=float(dflash_value(cfg, "input_embedding_scale", 1.0)),
    )


def draft_tp_shardable(spec: DraftSpec, world_size: int) -> bool:
    """The drafter's heads, KV heads and MLP width all divide ``world_size``."""
    return all(n % world_size == 0 for n in (spec.num_heads, spec.num_kv_heads, spec.intermediate_size))


def resolve_draft_tp(spec: DraftSpec, target: nn.Module | None,
                     tp: TensorParallel | None) -> TensorParallel:
    """The drafter's tensor parallelism: ``tp`` as given (``SINGLE``: replicated on every rank;
    the target's: sharded as the target's layers are), or with ``None`` the target's where the
    drafter's widths divide its ranks (:func:`draft_tp_shardable`), else replicated.

    Sharded (vLLM's ``draft_tensor_parallel_size`` = the target's), a rank holds ``1 / world_size``
    of each drafter layer's heads, KV heads and MLP width, and of its cache's rows: the same rows
    as the target's, so its context K/V can live in the target's pool (engine, hybrid layout).
    ``fc`` and the norms stay replicated: the taps they read are every rank's same bits."""
    if tp is not None:
        return tp
    target_tp = getattr(target, "tp", SINGLE)
    if target_tp.is_parallel and not draft_tp_shardable(spec, target_tp.world_size):
        logger.info("the drafter's heads (%d), KV heads (%d) or MLP width (%d) do not divide "
                    "tensor_parallel_size=%d: it is replicated on every rank", spec.num_heads,
                    spec.num_kv_heads, spec.intermediate_size, target_tp.world_size)
        return SINGLE
    return target_tp


class DFlashDraftModel(nn.Module):
    """DFlash drafter, Qwen3 flavour: ``context = hidden_norm(fc(taps))`` feeds every layer's K/V."""

    architecture = "DFlashDraftModel"
    fused_qkv_on_disk = False  # z-lab checkpoints store q/k/v split
    use_triton_context_kv = True  # False forces the torch context-K/V path (set per instance)

    def __init__(self, spec: DraftSpec, target: nn.Module | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp  # the target's ranks (layers sharded as the target's), or SINGLE (replicated)
        self.rotaries, by_spec = build_rotaries([spec.rope])
        self.rotary = by_spec[spec.rope]
        self.fc = nn.Linear(len(spec.target_layer_ids) * spec.target_hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(self._make_attention(i, layer),
                         MLP(spec.hidden_size, spec.intermediate_size, tp=tp),
                         spec.hidden_size, spec.rms_norm_eps)
            for i, layer in enumerate(spec.layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # The target is shared, not owned: keep it out of the module tree (no copy, no re-init).
        object.__setattr__(self, "target", target)
        self.mask_embedding: torch.Tensor | None = None
        self.checkpoint_dir: Path | None = None
        # (Wq [V, H] float8_e4m3fn, scale [V] float32): the drafter's fp8 copy of the shared
        # lm_head (models/fp8.py quantize_drafter); None: the target's
        self.lm_head_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        # a reduced draft vocabulary (models/draft_vocab.py, set_draft_vocab): the token ids
        # [V_d] int64 drafts are picked among, and their lm_head rows [V_d, H] (the same on every
        # rank); None: the whole vocabulary
        self.draft_vocab_ids: torch.Tensor | None = None
        self.draft_head: torch.Tensor | None = None

    def _make_attention(self, index: int, layer: DraftLayerSpec) -> Attention:
        s = self.spec
        return Attention(
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, self.rotary, cache_index=index,
            sliding_window=layer.sliding_window, gating=layer.gating, has_sinks=layer.has_sinks,
            qkv_bias=s.qkv_bias, o_bias=s.qkv_bias, eps=s.rms_norm_eps, is_causal=layer.is_causal,
            tp=self.tp,
        )

    @classmethod
    def from_config(cls, cfg: dict, shapes: dict | None = None, target: nn.Module | None = None,
                    tp: TensorParallel | None = None):
        spec = qwen3_draft_spec(cfg, target, cls.architecture)
        return cls(spec, target, resolve_draft_tp(spec, target, tp))

    # ---- properties the engine reads ---------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def mask_token_id(self) -> int:
        return self.spec.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.spec.target_layer_ids

    @property
    def is_causal(self) -> bool:
        """Default block causality (layers carry their own; this is used for the metadata)."""
        return all(layer.is_causal for layer in self.spec.layers)

    @property
    def num_cache_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's cache holds (all of them unless the drafter is sharded)."""
        return self.spec.num_kv_heads // self.tp.world_size

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    # ---- loading -------------------------------------------------------------------------------

    def checkpoint_groups(self, prefix: str = "") -> list[Group]:
        groups: list[Group] = [
            [[(prefix + "fc.weight", self.fc.weight)]],
            [[(prefix + "hidden_norm.weight", self.hidden_norm.weight)]],
            [[(prefix + "norm.weight", self.norm.weight)]],
        ]
        for i, layer in enumerate(self.layers):
            p = f"{prefix}layers.{i}."
            groups += [
                [[(p + "input_layernorm.weight", layer.input_layernorm.weight)]],
                [[(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)]],
            ]
            groups += attention_groups(layer.self_attn, p + "self_attn.", self.fused_qkv_on_disk)
            groups += mlp_groups(layer.mlp, p + "mlp.")
        return groups

    def ignorable_tensors(self) -> set[str]:
        return set()

    def post_load(self) -> None:
        """Bind the target's embedding / lm_head, load ``mask_embedding.pt``, build KV buffers."""
        t = self.target
        if t is None:
            raise ValueError("a DFlash drafter needs its target model: load it through LLM(model=..., draft=...)")
        vocab = t.spec.vocab_size
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(
                f"dflash_config.mask_token_id={self.mask_token_id} is outside the target vocabulary [0, {vocab})"
            )
        if self.checkpoint_dir is not None and (self.checkpoint_dir / "mask_embedding.pt").is_file():
            emb = torch.load(self.checkpoint_dir / "mask_embedding.pt", map_location="cpu", weights_only=True)
            if isinstance(emb, dict):
                emb = next(iter(emb.values()))
            emb = emb.reshape(-1)
            if emb.numel() != t.spec.hidden_size:
                raise ValueError(
                    f"mask_embedding.pt has {emb.numel()} values; expected the target hidden size "
                    f"{t.spec.hidden_size}"
                )
            self.mask_embedding = emb.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        self._build_context_kv_buffers()

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.target.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target.lm_head_weight

    def prepare_rope(self, max_positions: int, device: torch.device | str) -> None:
        self.rotary.ensure(max_positions)
        self.rotary.to(device)

    # ---- context K/V -----------------------------------------------------------------------------

    def combine_hidden_states(self, taps: torch.Tensor) -> torch.Tensor:
        """Taps ``[N, n_taps * H_t]`` -> context rows ``[N, H]``: Qwen3 flavour is ``fc`` only
        (``hidden_norm`` is applied in the projection, as in vLLM)."""
        return linear(taps.to(self.fc.weight.dtype), self.fc.weight, self.fc.bias)

    def _build_context_kv_buffers(self) -> None:
        """Stack every layer's K|V rows ``[L * 2 * kv, H]`` and K-norm weights ``[L, hd]``."""
        rows = [layer.self_attn.qkv_proj.weight[layer.self_attn.q_size :] for layer in self.layers]
        self.context_kv_weight = torch.cat(rows, dim=0).contiguous()
        biases = [layer.self_attn.qkv_proj.bias for layer in self.layers]
        self.context_kv_bias = (
            torch.cat([b[layer.self_attn.q_size :] for b, layer in zip(biases, self.layers)])
            if biases[0] is not None else None
        )
        self.context_k_norm_weight = torch.stack([layer.self_attn.k_norm.weight for layer in self.layers])

    def _project_context_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE GEMM for all layers: ``[N, H]`` -> K, V each ``[L, N, kv_heads, hd]``."""
        return self._split_context_kv(
            linear(self.hidden_norm(context), self.context_kv_weight, self.context_kv_bias))

    def _split_context_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, L * 2 * kv]`` GEMM output -> K, V each ``[L, N, kv_heads, hd]`` (layer-major; the
        rank's KV heads when sharded)."""
        s = self.spec
        kv = kv.view(kv.shape[0], len(self.layers), 2, self.num_kv_heads, s.head_dim).permute(2, 1, 0, 3, 4)
        return kv[0], kv[1]

    def _normalize_context_k(self, k: torch.Tensor) -> torch.Tensor:
        """One grouped K-RMSNorm: ``k [L, N, kv_heads, hd]`` with weight row ``l`` for layer ``l``."""
        return rms_norm_grouped(k, self.context_k_norm_weight, self.spec.rms_norm_eps)

    def precompute_and_store_context_kv(
        self, context: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Write context K/V for ``context [N, H]`` at ``positions [N]`` / ``slots [N]`` into every
        layer's cache: one GEMM, one grouped K-norm, one RoPE over all layers, the writes.

        On CUDA with triton, K-norm + RoPE + writes run as ONE Triton launch
        (``kernels/context_kv.py``), unless ``use_triton_context_kv`` is False or a flavour
        overrides ``_normalize_context_k``; elsewhere the torch ops below."""
        k, v = self._project_context_kv(context)
        if (self.use_triton_context_kv and k.is_cuda
                and type(self)._normalize_context_k is DFlashDraftModel._normalize_context_k
                and context_kv_kernels.is_available(k.device)):
            context_kv_kernels.fused_context_kv_(
                k, v, self.context_k_norm_weight, self.spec.rms_norm_eps, self.rotary.cos,
                self.rotary.sin, positions, slots, kv_caches)
            return
        k = self._normalize_context_k(k)
        num_layers, n = k.shape[0], k.shape[1]
        k = self.rotary.apply(k.reshape(num_layers * n, *k.shape[2:]), positions.repeat(num_layers))
        k = k.view(num_layers, n, *k.shape[1:])
        for layer_idx, (k_cache, v_cache) in enumerate(kv_caches):
            k_cache.index_copy_(0, slots, k[layer_idx].to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v[layer_idx].to(v_cache.dtype))

    def context_kv_input(self, layer: DecoderLayer, context: torch.Tensor) -> torch.Tensor:
        """What a layer's K/V projection reads from a context row (reference path)."""
        return self.hidden_norm(context)

    def reference_context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer loop (the reference the fused path is tested against): ``[(K_l, V_l)]``."""
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            x = self.context_kv_input(layer, context)
            kv = F.linear(x, attn.qkv_proj.weight[attn.q_size :],
                          None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[attn.q_size :])
            k, v = kv.view(x.shape[0], 2, attn.num_kv_heads, attn.head_dim).unbind(1)
            out.append((self.rotary.apply(attn.k_norm(k), positions), v))
        return out

    # ---- block forward ---------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` -> ``[T, H]`` through the target's (vocabulary-parallel) embedding."""
        h = self.target.embed_tokens(input_ids)
        if self.spec.input_embedding_scale != 1.0:
            h = h * self.spec.input_embedding_scale
        if self.mask_embedding is not None:
            is_mask = (input_ids == self.mask_token_id).unsqueeze(-1)
            h = torch.where(is_mask, self.mask_embedding.to(h.dtype), h)
        return h

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, tap_layer_ids: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, None]:
        """Block forward: ``input_ids [R*(K+1)]`` -> final-normed hidden ``[R*(K+1), H]``.

        Block K/V are written at the block's positions; the context K/V already in the cache
        (positions ``< P``) and the block are visible per each layer's causality / window.
        """
        return run_layers(self.layers, self.embed(input_ids), ctx, self.norm)[0], None

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft among ``token_ids [V_d]`` (int64, distinct, inside the vocabulary:
        ``draft_vocab.load_token_map`` checks a file) only: keeps their rows of the shared lm_head
        (``draft_head``, the same on every rank, so the draft logits need no gather). Inference
        only; before ``fp8.quantize_drafter``, which then quantizes these rows alone. The verify
        is unchanged, so the output is too (models/draft_vocab.py)."""
        assert self.lm_head_fp8 is None, "set the draft vocabulary before quantizing the drafter"
        self.draft_head = restrict_rows(self.lm_head_weight, token_ids, self.target.tp)
        self.draft_vocab_ids = token_ids.to(self.draft_head.device)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the TARGET's lm_head: ``[N, H]`` -> ``[N, V]`` in its dtype
        (each tensor-parallel rank's vocabulary columns, gathered), or ``[N, V_d]`` over the
        draft vocabulary where :meth:`set_draft_vocab` set one (column ``j`` is token
        ``draft_vocab_ids[j]``); through the drafter's fp8 copy of those rows where
        ``fp8.quantize_drafter`` made one (``lm_head_fp8``; past 16 rows on CUDA the unquantized
        rows, as :func:`fp8.fp8_linear` says)."""
        weight = self.lm_head_weight if self.draft_head is None else self.draft_head
        if self.lm_head_fp8 is not None:
            logits = fp8_linear(hidden, *self.lm_head_fp8, unquantized=weight)
        else:
            logits = lm_head_linear(hidden, weight)
        return logits if self.draft_head is not None else self.target.tp.all_gather_last(logits)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of :meth:`lm_head_logits` ``(hidden [N, H])`` -> ``[N]`` int64 token ids
        (mapped through ``draft_vocab_ids`` where a draft vocabulary is set): through the target's
        int8 lm_head copy where it has one and takes these rows (the exact argmax, the same drafts
        for half the lm_head's bytes: kernels/greedy_lm_head.py), else the logits. The fp8 copy
        (``lm_head_fp8``) and the draft vocabulary keep their own logits: the drafter chose them."""
        if self.lm_head_fp8 is None and self.draft_vocab_ids is None:
            tokens = self.target.greedy_tokens(hidden)
            if tokens is not None:
                return tokens
        best = argmax_rows(self.lm_head_logits(hidden))
        return best if self.draft_vocab_ids is None else self.draft_vocab_ids[best]

    def draft_candidates(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` likeliest tokens of each row of :meth:`lm_head_logits` ``(hidden [N,
        H])``, most likely first -> ``[N, count]`` int64 token ids (mapped through
        ``draft_vocab_ids`` where a draft vocabulary is set): the choices a constrained
        request's drafts are taken from (structured_outputs.ConstraintMatcher.guided_drafts)."""
        logits = self.lm_head_logits(hidden)
        best = logits.topk(min(count, logits.shape[-1]), dim=-1).indices
        return best if self.draft_vocab_ids is None else self.draft_vocab_ids[best]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the TARGET's lm_head: ``[N, H]`` -> ``[N, V]`` float32 (``[N,
        V_d]`` with a draft vocabulary, as :meth:`lm_head_logits`)."""
        return self.lm_head_logits(hidden).float()
