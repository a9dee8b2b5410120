"""Tiny DFlash fixtures and the PyPI ``dflash`` reference, for the ``laguna_dflash`` tests.

This is a helper module (not collected by pytest).  It builds tiny random *targets*
(transformers ``Qwen3ForCausalLM`` / ``LagunaForCausalLM``), tiny DFlash *drafters* in the two
on-disk formats the engine must read, and runs the z-lab reference loop
``dflash.model.dflash_generate`` (PyPI ``dflash==0.1.0``) as the oracle.  Nothing from
``dflash`` or ``transformers`` is copied here: they are only called.

Public helpers
--------------
* :func:`make_tiny_qwen3_target`, :func:`make_tiny_laguna_target`: float32 ``save_pretrained``
  checkpoints, vocabulary 64, hidden 32, head_dim 8, 4 layers.  The Laguna one has full and
  sliding layers (``sliding_window=4``, so short tests already cross the window), per-layer head
  counts, per-head gating, 4 experts (top-2) plus a shared expert, norms ``1 + 0.1*randn`` and a
  non-zero ``e_score_correction_bias``.  Linear weights are ``N(0, gain^2/fan_in)`` with
  ``gain = 0.6`` (residual stream dominated by the token embedding: greedy text is varied but
  learnable), ``lm_head`` gives logits of std ~3 (no near-ties, so cached and uncached runs agree).
* :func:`make_zlab_drafter`: a z-lab ``DFlashDraftModel`` checkpoint (see "z-lab format").
* :func:`make_poolside_laguna_drafter`: a Poolside ``DFlashLagunaForCausalLM`` checkpoint written
  by hand (no reference class exists; see "Poolside format").  Random weights, no oracle.
* :func:`reference_dflash_generate`, :func:`reference_target_greedy`: the oracles.
* :func:`load_reference_target`, :func:`load_reference_drafter`: the loaders they use.

z-lab format (what ``make_zlab_drafter`` writes, checked in the tests)
----------------------------------------------------------------------
``config.json``: ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"``, the usual
Qwen3 fields, top-level ``num_target_layers`` and ``dflash_config = {block_size, mask_token_id,
target_layer_ids}`` (``block_size_top_level=True`` moves ``block_size`` to the top level, as in the
published ``z-lab/*-DFlash-b16`` configs).  ``model.safetensors`` (float32, NO ``model.`` prefix,
no ``embed_tokens``, no ``lm_head``, no rotary buffers), with ``H`` = target hidden size,
``n`` = ``len(target_layer_ids)``, ``nh``/``nkv``/``hd`` = draft heads/KV heads/head_dim::

    fc.weight                                  [H, n*H]
    hidden_norm.weight                         [H]
    norm.weight                                [H]
    layers.{i}.input_layernorm.weight          [H]
    layers.{i}.post_attention_layernorm.weight [H]
    layers.{i}.self_attn.q_proj.weight         [nh*hd, H]
    layers.{i}.self_attn.k_proj.weight         [nkv*hd, H]
    layers.{i}.self_attn.v_proj.weight         [nkv*hd, H]
    layers.{i}.self_attn.o_proj.weight         [H, nh*hd]
    layers.{i}.self_attn.q_norm.weight         [hd]
    layers.{i}.self_attn.k_norm.weight         [hd]
    layers.{i}.mlp.{gate_proj,up_proj}.weight  [I, H]
    layers.{i}.mlp.down_proj.weight            [H, I]

The drafter's hidden size must equal the target's (its block input is the target embedding).
By default the drafter is *partly informed*: after random initialisation it is distilled for
``distill_steps=200`` Adam steps (~0.6 s) on the target's own greedy continuations, with the
DFlash training recipe (context = target taps of positions ``< a``, block ``[x_a, MASK...]`` at
positions ``a..a+B-1``, same-position labels through the frozen target ``lm_head``).  A purely
random drafter almost never matches (tau ~1.02 over 40 tokens); ``distill_steps=0`` gives one.

Poolside format (what ``make_poolside_laguna_drafter`` writes; reference/laguna.md 4.1, 4.2)
---------------------------------------------------------------------------------------------
``config.json``: ``architectures: ["DFlashLagunaForCausalLM"]``, ``model_type: "laguna"``, top-level
``rope_theta`` (no ``rope_parameters``), ``layer_types`` all ``"sliding_attention"``,
``gating: "per-head"``, ``num_experts: 0``, ``draft_vocab_size == vocab_size``,
``eagle_aux_hidden_state_layer_ids = [t + 1 for t in target_layer_ids]`` and ``dflash_config =
{block_size, mask_token_id, num_target_layers, target_layer_ids, causal: true}``.
``model.safetensors`` (dtype as requested, no ``model.`` prefix, no embeddings, no ``lm_head``)::

    fc.weight                                  [H, n*H_target]
    hidden_norm.weight                         [H]
    norm.weight                                [H]
    aux_hidden_norms.{j}.weight                [H_target]       j = 0..n-1, in tap order
    layers.{i}.input_layernorm.weight          [H]
    layers.{i}.post_attention_layernorm.weight [H]
    layers.{i}.self_attn.qkv_proj.weight       [(nh+2*nkv)*hd, H]   rows Q | K | V
    layers.{i}.self_attn.o_proj.weight         [H, nh*hd]
    layers.{i}.self_attn.g_proj.weight         [nh, H]
    layers.{i}.self_attn.q_norm.weight         [hd]
    layers.{i}.self_attn.k_norm.weight         [hd]
    layers.{i}.mlp.{gate_proj,up_proj}.weight  [I, H]
    layers.{i}.mlp.down_proj.weight            [H, I]

What ``dflash==0.1.0`` (``dflash/model.py``) actually does
---------------------------------------------------------
Config keys.  ``_draft_value(config, name, default)`` returns ``config.dflash_config[name]`` if
present, else the top-level attribute ``config.<name>``, else ``default``.  Read that way:
``target_layer_ids`` (default ``build_target_layer_ids(num_target_layers, num_hidden_layers)``),
``block_size`` (default 16), ``mask_token_id`` (default ``None``), ``input_embedding_scale``
(1.0, multiplies the block embedding), ``output_multiplier`` (1.0, multiplies draft logits),
``final_logit_softcapping`` (None; ``tanh`` cap on draft logits), and for ``DFlash2DraftModel``
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``.
Read ONLY at the top level (``dflash_config`` is ignored for them):

* ``num_target_layers``: required at the top level even when ``target_layer_ids`` is given
  (the default argument ``build_target_layer_ids(config.num_target_layers, ...)`` is evaluated
  eagerly, so a config without it raises ``AttributeError``; ``dflash_config.num_target_layers``,
  as in the Poolside format, is not read);
* ``layer_types`` (missing -> all ``full_attention``), ``sliding_window`` (note: ``Qwen3Config``
  resets it to ``None`` unless ``use_sliding_window=True``), ``is_causal``;
* the Qwen3 fields (``hidden_size``, heads, ``head_dim``, ``rms_norm_eps``, ``rope_parameters``,
  ``attention_bias``, ...).

Causality / window.  Per layer: ``is_causal = (layer_type == "sliding_attention")`` unless a
top-level ``is_causal`` is set, which then applies to every layer.  ``dflash_config.causal`` (the
Poolside key) is NOT read.  A non-causal full layer gets no mask at all: every block query sees
all context keys and every block key, i.e. attention inside the block is bidirectional.  Causal
and/or sliding layers get a boolean mask (``key <= query``; window: ``query - key < W``, i.e. W
keys including itself, and symmetric ``key - query < W`` when non-causal).  Attention always goes
through the ``"sdpa"`` kernel.  There is no attention-sink support (no ``sink`` /
``attention_sink_bias`` parameter is created or read).

Context and positions.  ``target_hidden = hidden_norm(fc(concat_t hidden_states[t + 1]))`` (HF
``output_hidden_states`` index ``t + 1`` = output of decoder layer ``t``; transformers replaces
the LAST entry, ``hidden_states[L]``, by the final-norm output, so a tap on layer ``L - 1`` is
post-norm in the reference).  The context rows go through the same ``k_proj``/``v_proj``/
``k_norm`` as the block rows but with no ``input_layernorm``.  One ``position_ids`` slice
``[start - n_ctx, start + verify_size)`` is used: new context rows keep their absolute positions
and block slot ``k`` gets position ``start + k`` (``start`` = position of the bonus token); Q uses
the last ``q_len`` cos/sin rows, K all of them.  The draft ``DynamicCache`` keeps context K/V and is
cropped back to ``start`` right after drafting (block K/V never survive).

Embeddings / head.  The block ``[bonus, MASK, ...]`` is embedded with
``F.embedding(ids, target.get_input_embeddings().weight) * input_embedding_scale`` (raw table
lookup, any embedding scaling module of the target is bypassed).  Draft logits are
``target.lm_head(norm(h))`` (falls back to ``get_output_embeddings()``) for block slots
``1..verify_size-1``; slot 0's output is discarded.

Decoding.  Temperature 0: drafts are ``argmax``; acceptance is the longest prefix with
``draft[k] == argmax(target)[k-1]``, plus the target's token at the first mismatch.  Temperature
> 0: drafts are SAMPLED from ``softmax(draft_logits / T)`` (after top-k/top-p), and verification is
proper speculative (rejection) sampling ``accept if u * q(d) < p(d)`` with a residual
``max(p - q, 0)`` resample (``_rejection_sample``), not an exact-match rule.
Loop: ``while start + 1 < max_len``; ``verify_size = min(block_size, max_len - start)`` (the last
block is shorter); ``output_ids`` has ``max_len + 1`` slots pre-filled with ``mask_token_id``; a
stop-token scan covers only the freshly written slice.

Acceptance lengths.  ``dflash_generate(..., return_stats=True)`` returns
``stats.acceptance_lengths``: per verify step ``produced = min(a + 1, max_len - start - 1)``
(also cut at a stop token), so the last entry can be clipped by the ``max_new_tokens`` budget and
``sum(taus) == len(generated) - 1`` (the first generated token comes from the prefill).  But
``return_stats=True`` calls ``dflash.model._cuda_time`` which runs ``torch.cuda.synchronize()``
unconditionally (fails on CPU-only torch), so :func:`reference_dflash_generate` patches that one
module attribute inside a context manager (:func:`_cpu_safe_dflash_timing`) for the duration of
the call; the installed package is not modified.

Laguna targets.  ``LagunaForCausalLM`` returns ``hidden_states`` (``L + 1`` entries) with
``output_hidden_states=True``, and dflash's ``DynamicCache(config=target.config)`` +
``activate_past_recording()`` + ``crop(-k)`` works on its sliding layers
(``DynamicSlidingWindowLayer`` keeps the full states until the crop, then trims to ``W - 1``), so
no workaround is needed: the reference is lossless on a Laguna target whose sliding window is
much shorter than the generated text (checked in the tests).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import unittest.mock
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "load_reference_drafter",
    "load_reference_target",
    "make_poolside_laguna_drafter",
    "make_tiny_laguna_target",
    "make_tiny_qwen3_target",
    "make_zlab_drafter",
    "reference_dflash_generate",
    "reference_target_greedy",
]

DEFAULT_VOCAB_SIZE = 64
_TARGET_LINEAR_GAIN = 0.6  # < 1: embedding-dominated residual stream, varied but learnable text
_DRAFT_LINEAR_GAIN = 1.0
_LOGIT_SCALE = 3.0  # std of target logits (lm_head rows ~ N(0, 9/H) on a unit-RMS hidden)


# ---------------------------------------------------------------------------------------------
# Random initialisation
# ---------------------------------------------------------------------------------------------


def _randomise_(model: torch.nn.Module, seed: int, linear_gain: float) -> None:
    """Overwrite every parameter of ``model`` in place, deterministically from ``seed``.

    1-D tensors: ``*bias`` (incl. ``e_score_correction_bias``) ~ ``0.1*randn``, norm weights
    ``1 + 0.1*randn``.  ``embed_tokens`` ~ ``randn``.  ``lm_head`` ~ ``randn * 3/sqrt(H)``.
    Everything else (linears ``[out, in]``, fused experts ``[E, out, in]``) ~
    ``randn * linear_gain / sqrt(in)``.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1:
                value = 0.1 * noise if name.endswith("bias") else 1.0 + 0.1 * noise
            elif "embed_tokens" in name:
                value = noise
            elif "lm_head" in name:
                value = noise * _LOGIT_SCALE / math.sqrt(p.shape[-1])
            else:
                value = noise * linear_gain / math.sqrt(p.shape[-1])
            p.copy_(value.to(p.dtype))


def _greedy_no_cache(
    model: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """Greedy continuation by re-running the whole sequence each step (no KV cache).

    Args:
        ids: ``[batch, T]`` int64 prompts (no padding).
    Returns:
        ``[batch, T + max_new_tokens]`` int64.
    """
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def _check_not_degenerate(model: torch.nn.Module, vocab_size: int) -> None:
    """Raise if greedy decoding from a fixed prompt is (nearly) a single repeated token."""
    prompt = torch.arange(1, 6)[None] % vocab_size
    gen = _greedy_no_cache(model, prompt, 24)[0, 5:].tolist()
    if len(set(gen)) < 4:
        raise AssertionError(f"degenerate tiny target, greedy output {gen}")


def _save_model(model: torch.nn.Module, directory: str | Path) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def make_tiny_qwen3_target(
    directory: str | Path, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE, **overrides: Any
) -> Path:
    """Write a random float32 ``Qwen3ForCausalLM`` with ``save_pretrained`` and return its dir.

    Defaults: hidden 32, intermediate 64, 4 layers, 4 heads / 2 KV heads, head_dim 8, untied
    ``lm_head``, no BOS/EOS.  ``overrides`` are ``Qwen3Config`` keyword arguments.
    Greedy output is checked to be non-degenerate.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    config = Qwen3Config(**kwargs)
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).eval()
    _randomise_(model, seed, _TARGET_LINEAR_GAIN)
    _check_not_degenerate(model, config.vocab_size)
    return _save_model(model, directory)


def _laguna_layer_lists(num_layers: int) -> dict[str, list[Any]]:
    """Per-layer lists for a tiny Laguna: full attention at ``i % 3 == 0``, else sliding."""
    layer_types = [
        "full_attention" if i % 3 == 0 else "sliding_attention" for i in range(num_layers)
    ]
    return {
        "layer_types": layer_types,
        "num_attention_heads_per_layer": [4 if t == "full_attention" else 8 for t in layer_types],
        "mlp_layer_types": ["dense"] + ["sparse"] * (num_layers - 1),
    }


def make_tiny_laguna_target(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random float32 ``LagunaForCausalLM`` with ``save_pretrained`` and return its dir.

    Defaults: vocab 64, hidden 32, 4 layers ``[full, sliding, sliding, full]`` with
    ``sliding_window=4``, 4/8/8/4 query heads, 2 KV heads, head_dim 8, per-head gating, layer 0
    dense (intermediate 64), layers 1-3 MoE with 4 experts (top-2, intermediate 16) + a shared
    expert (16), routed scaling 2.5, nested ``rope_parameters`` (full: theta 5e5, partial 0.5;
    sliding: theta 1e4, partial 1.0), norms ``1 + 0.1*randn``, ``e_score_correction_bias``
    ``0.1*randn``.  ``overrides`` are ``LagunaConfig`` keyword arguments; overriding
    ``num_hidden_layers`` regenerates the per-layer lists unless they are given too.
    """
    from transformers import LagunaConfig, LagunaForCausalLM

    num_layers = int(overrides.get("num_hidden_layers", 4))
    kwargs: dict[str, Any] = dict(
        vocab_size=DEFAULT_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        gating="per-head",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        moe_routed_scaling_factor=2.5,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 500000.0,
                "partial_rotary_factor": 0.5,
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0,
            },
        },
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **_laguna_layer_lists(num_layers),
    )
    kwargs.update(overrides)
    config = LagunaConfig(**kwargs)
    config._attn_implementation = "eager"
    model = LagunaForCausalLM(config).eval()
    _randomise_(model, seed, _TARGET_LINEAR_GAIN)
    _check_not_degenerate(model, config.vocab_size)
    return _save_model(model, directory)


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------


def load_reference_target(
    target_dir: str | Path, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Load a target checkpoint with transformers: float32, eager attention, eval mode, frozen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, attn_implementation="eager"
    )
    model.requires_grad_(False)
    return model.to(device).eval()


def load_reference_drafter(
    draft_dir: str | Path, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Load a z-lab drafter with ``dflash.model.DFlashDraftModel.from_pretrained`` (float32)."""
    from dflash.model import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32)
    return model.to(device).eval()


def _target_config(target_dir: str | Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(target_dir))


def _default_taps(num_target_layers: int) -> list[int]:
    """Two distinct taps, never the last layer: L=4 -> [1, 2]; L=3 -> [1]; L=2 -> [0]."""
    if num_target_layers >= 4:
        return [1, num_target_layers - 2]
    return [max(num_target_layers - 2, 0)]


def _resolve_draft_ids(
    tcfg: Any, mask_token_id: int | None, target_layer_ids: Sequence[int] | None
) -> tuple[int, list[int]]:
    vocab, num_layers = int(tcfg.vocab_size), int(tcfg.num_hidden_layers)
    mask = vocab - 1 if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask < vocab:
        raise ValueError(f"mask_token_id {mask} is not a row of the target vocabulary ({vocab})")
    taps = (
        _default_taps(num_layers)
        if target_layer_ids is None
        else [int(t) for t in target_layer_ids]
    )
    if not taps or any(not 0 <= t < num_layers for t in taps):
        raise ValueError(f"target_layer_ids {taps} out of range for a {num_layers}-layer target")
    return mask, taps


# ---------------------------------------------------------------------------------------------
# z-lab drafter
# ---------------------------------------------------------------------------------------------


def _distill_zlab_drafter(
    draft: torch.nn.Module, target: torch.nn.Module, steps: int, seed: int, lr: float = 1e-2
) -> float:
    """Briefly train ``draft`` on the target's greedy text with the DFlash recipe; return last loss.

    Data: 64 random 4-token prompts, 40 greedy target tokens each.  Each step picks one anchor
    ``a`` for the whole batch; context = taps of positions ``< a``; block = ``[x_a, MASK*(B-1)]``
    at positions ``a..a+B-1``; loss = CE of slots ``1..B-1`` against ``x_{a+1..a+B-1}`` through the
    frozen target ``lm_head``.
    """
    gen = torch.Generator().manual_seed(seed + 12345)
    vocab = int(target.config.vocab_size)
    block, mask = int(draft.block_size), int(draft.mask_token_id)
    n_seq, prompt_len = 64, 4
    prompts = torch.randint(0, vocab, (n_seq, prompt_len), generator=gen)
    seqs = _greedy_no_cache(target, prompts, 40)  # [n_seq, T]
    with torch.no_grad():
        hidden = target(input_ids=seqs, output_hidden_states=True, use_cache=False).hidden_states
        ctx_all = torch.cat([hidden[t + 1] for t in draft.target_layer_ids], dim=-1)
    embed = target.get_input_embeddings().weight
    total = seqs.shape[1]
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    draft.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        a = int(torch.randint(prompt_len, total - block + 1, (1,), generator=gen))
        ids = torch.full((n_seq, block), mask, dtype=torch.long)
        ids[:, 0] = seqs[:, a]
        positions = torch.arange(a + block)[None].expand(n_seq, -1)
        out = draft(
            position_ids=positions,
            noise_embedding=F.embedding(ids, embed),
            target_hidden=ctx_all[:, :a],
        )
        logits = target.lm_head(out[:, 1:])
        loss = F.cross_entropy(logits.reshape(-1, vocab), seqs[:, a + 1 : a + block].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    return float(loss.item())


def make_zlab_drafter(
    directory: str | Path,
    target_dir: str | Path,
    seed: int = 0,
    num_layers: int = 1,
    block_size: int = 4,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    *,
    distill_steps: int = 200,
    block_size_top_level: bool = False,
    **overrides: Any,
) -> Path:
    """Write a z-lab format ``DFlashDraftModel`` checkpoint for the target in ``target_dir``.

    Args:
        directory: output directory (created).
        target_dir: a target written by :func:`make_tiny_qwen3_target` /
            :func:`make_tiny_laguna_target` (any HF causal LM with ``hidden_states`` works).
        seed: weight seed.
        num_layers: draft decoder layers.
        block_size: B (slot 0 + B-1 mask slots).
        mask_token_id: a row of the target vocabulary; default ``vocab_size - 1``.
        target_layer_ids: 0-based target layers whose OUTPUT is tapped; default ``[1, L-2]``.
        distill_steps: Adam steps of the short distillation (0 = purely random weights).
        block_size_top_level: put ``block_size`` at the top level of ``config.json`` instead of
            inside ``dflash_config`` (the published z-lab configs do this; dflash reads both).
        overrides: ``Qwen3Config`` keyword arguments for the drafter (e.g.
            ``num_attention_heads``, ``layer_types``, ``use_sliding_window``, ``is_causal``).  A
            ``dflash_config`` dict here is merged into the generated one.
    Returns:
        ``Path(directory)``, containing ``config.json`` and ``model.safetensors``.
    """
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    tcfg = _target_config(target_dir)
    mask, taps = _resolve_draft_ids(tcfg, mask_token_id, target_layer_ids)
    hidden = int(tcfg.hidden_size)
    dflash_config: dict[str, Any] = {
        "block_size": int(block_size),
        "mask_token_id": mask,
        "target_layer_ids": taps,
    }
    dflash_config.update(overrides.pop("dflash_config", {}))
    top_level: dict[str, Any] = {}
    if block_size_top_level:
        top_level["block_size"] = dflash_config.pop("block_size")
    kwargs: dict[str, Any] = dict(
        vocab_size=int(tcfg.vocab_size),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=int(num_layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=max(hidden // 4, 8),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 512)),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_target_layers=int(tcfg.num_hidden_layers),
        dflash_config=dflash_config,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **top_level,
    )
    kwargs.update(overrides)
    if kwargs["hidden_size"] != hidden:
        raise ValueError(
            "a z-lab drafter's hidden_size must equal the target's (shared embeddings)"
        )
    draft = DFlashDraftModel(Qwen3Config(**kwargs))
    _randomise_(draft, seed + 1000, _DRAFT_LINEAR_GAIN)
    if distill_steps > 0:
        _distill_zlab_drafter(draft, load_reference_target(target_dir), distill_steps, seed)
    return _save_model(draft.eval(), directory)


# ---------------------------------------------------------------------------------------------
# Poolside drafter
# ---------------------------------------------------------------------------------------------


def make_poolside_laguna_drafter(
    directory: str | Path,
    target_dir: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    block_size: int = 4,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Write a Poolside ``DFlashLagunaForCausalLM`` checkpoint by hand (laguna.md 4.1 / 4.2).

    Args:
        directory: output directory (created).
        target_dir: the target checkpoint (its ``hidden_size``, ``vocab_size``,
            ``num_hidden_layers`` and ``max_position_embeddings`` are used).
        seed: weight seed.
        num_layers: draft layers (all ``sliding_attention``).
        block_size: B.
        mask_token_id: a row of the target vocabulary; default ``vocab_size - 1``.
        target_layer_ids: 0-based tapped target layers; default ``[1, L-2]``.
        dtype: dtype of every tensor in ``model.safetensors`` (``torch_dtype`` in the config).
        overrides: top-level ``config.json`` keys to set/replace (e.g. ``num_attention_heads``,
            ``head_dim``, ``sliding_window``, ``rope_theta``); a ``dflash_config`` dict is merged.
    Returns:
        ``Path(directory)`` with ``config.json`` and ``model.safetensors``.

    Weights: linears ``randn / sqrt(fan_in)``, every norm ``1 + 0.1*randn``.  Random, no oracle.
    """
    tcfg = _target_config(target_dir)
    mask, taps = _resolve_draft_ids(tcfg, mask_token_id, target_layer_ids)
    h_target = int(tcfg.hidden_size)
    dflash_config: dict[str, Any] = {
        "block_size": int(block_size),
        "mask_token_id": mask,
        "num_target_layers": int(tcfg.num_hidden_layers),
        "target_layer_ids": taps,
        "causal": True,
    }
    dflash_config.update(overrides.pop("dflash_config", {}))
    config: dict[str, Any] = {
        "architectures": ["DFlashLagunaForCausalLM"],
        "model_type": "laguna",
        "hidden_size": h_target,
        "intermediate_size": 2 * h_target,
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": max(h_target // 4, 8),
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "max_position_embeddings": int(getattr(tcfg, "max_position_embeddings", 512)),
        "sliding_window": 8,
        "layer_types": ["sliding_attention"] * int(num_layers),
        "gating": "per-head",
        "num_experts": 0,
        "vocab_size": int(tcfg.vocab_size),
        "draft_vocab_size": int(tcfg.vocab_size),
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in taps],
        "dflash_config": dflash_config,
    }
    config.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        config["layer_types"] = ["sliding_attention"] * int(config["num_hidden_layers"])

    hid, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    nh, nkv, hd = (
        int(config["num_attention_heads"]),
        int(config["num_key_value_heads"]),
        int(config["head_dim"]),
    )
    gen = torch.Generator().manual_seed(seed + 2000)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    tensors: dict[str, torch.Tensor] = {
        "fc.weight": linear(hid, len(taps) * h_target),
        "hidden_norm.weight": norm(hid),
        "norm.weight": norm(hid),
    }
    for j in range(len(taps)):
        tensors[f"aux_hidden_norms.{j}.weight"] = norm(h_target)
    for i in range(int(config["num_hidden_layers"])):
        p = f"layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm(hid)
        tensors[p + "post_attention_layernorm.weight"] = norm(hid)
        tensors[p + "self_attn.qkv_proj.weight"] = linear((nh + 2 * nkv) * hd, hid)
        tensors[p + "self_attn.o_proj.weight"] = linear(hid, nh * hd)
        tensors[p + "self_attn.g_proj.weight"] = linear(nh, hid)
        tensors[p + "self_attn.q_norm.weight"] = norm(hd)
        tensors[p + "self_attn.k_norm.weight"] = norm(hd)
        tensors[p + "mlp.gate_proj.weight"] = linear(inter, hid)
        tensors[p + "mlp.up_proj.weight"] = linear(inter, hid)
        tensors[p + "mlp.down_proj.weight"] = linear(hid, inter)

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(dtype).contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# Reference runs
# ---------------------------------------------------------------------------------------------



def make_laguna_poolside_pair(root: str | Path, block_size: int, seed: int = 0) -> tuple[Path, Path]:
    """``root/laguna`` (:func:`make_tiny_laguna_target`) and ``root/poolside``
    (:func:`make_poolside_laguna_drafter` on it, ``block_size``): -> (target, drafter)."""
    root = Path(root)
    target = make_tiny_laguna_target(root / "laguna", seed=seed)
    return target, make_poolside_laguna_drafter(root / "poolside", target, seed=seed,
                                                block_size=block_size)

def _sync_and_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def _cpu_safe_dflash_timing() -> Iterator[None]:
    """Make ``dflash_generate(..., return_stats=True)`` usable without CUDA.

    dflash 0.1.0's ``_cuda_time`` calls ``torch.cuda.synchronize()`` unconditionally; inside this
    context the ``dflash.model._cuda_time`` attribute is replaced by a CPU-safe timer (restored on
    exit).  Nothing else in the loop is touched.
    """
    import dflash.model

    with unittest.mock.patch.object(dflash.model, "_cuda_time", _sync_and_time):
        yield


def reference_dflash_generate(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[list[int], list[int]]:
    """Run the z-lab reference ``dflash.model.dflash_generate`` (batch size 1).

    Loads the target with transformers (float32, eager) and the drafter with
    ``DFlashDraftModel.from_pretrained``.  Sampling (``temperature > 0``) draws from the global
    torch RNG, seeded with ``seed`` inside ``torch.random.fork_rng`` (caller's RNG untouched).

    Returns:
        ``(generated, taus)``: ``generated`` = new token ids (prompt excluded; at most
        ``max_new_tokens``, fewer after a stop token, which is included); ``taus`` = dflash's own
        per-verify-step ``acceptance_lengths`` = ``a + 1`` accepted drafts plus the bonus token,
        clipped to the remaining budget on the last step (``sum(taus) == len(generated) - 1``
        without stop tokens; the first generated token comes from the prefill).
    """
    from dflash.model import dflash_generate

    target = load_reference_target(target_dir, device)
    draft = load_reference_drafter(draft_dir, device)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _cpu_safe_dflash_timing():
        torch.manual_seed(seed)
        stats = dflash_generate(
            draft,
            target,
            ids,
            max_new_tokens,
            stop_token_ids,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            block_size=block_size,
            return_stats=True,
        )
    generated = stats.output_ids[0, ids.shape[1] :].tolist()
    return generated, [int(t) for t in stats.acceptance_lengths]


def reference_target_greedy(
    target_dir: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    device: str | torch.device = "cpu",
) -> list[int]:
    """Target-only greedy continuation (prompt excluded), float32 eager transformers.

    Deliberately cache-free (the full sequence is re-run for every token) so that it does not
    share any KV-cache / crop code path with the speculative loop it is compared against.
    """
    target = load_reference_target(target_dir, device)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    return _greedy_no_cache(target, ids, max_new_tokens)[0, ids.shape[1] :].tolist()


def make_served_pair(root: str | Path, block_size: int, distill_steps: int) -> tuple[Path, Path]:
    """The tiny Laguna target (vocabulary 384, with a tokenizer) and a one-layer z-lab drafter
    distilled for ``distill_steps``, under ``root``: the pair the server and text-API tests use."""
    import hf_fixtures as hf

    root = Path(root)
    target = make_tiny_laguna_target(root / "target", seed=0, vocab_size=384)
    draft = make_zlab_drafter(root / "draft", target, num_layers=1, block_size=block_size,
                              distill_steps=distill_steps)
    hf.make_tokenizer(target, 384)
    return target, draft


@contextlib.contextmanager
def tiny_http_server(target: str | Path, *flags: str) -> Iterator[Any]:
    """A live ``serve`` on ``target`` (e.g. :func:`make_tiny_laguna_target`'s checkpoint) with
    8-token KV blocks, 32 of them, no periodic stats lines, and ``flags``; yields an
    ``httpx.Client`` on it and stops the server after."""
    import httpx

    from laguna_dflash.cli import build_parser
    from laguna_dflash.server.app import build_app
    from laguna_dflash.server.args import resolve_server_config
    from laguna_dflash.server.launcher import ServerThread, build_serving

    args = build_parser().parse_args([
        "serve", "--model", str(target), "--block-size", "8", "--num-kv-blocks", "32",
        "--log-stats-interval", "0", *flags])
    server = ServerThread(build_app(build_serving(resolve_server_config(args)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            yield http
    finally:
        server.stop()


def make_small_vocab_pair(root: str | Path) -> tuple[Path, Path]:
    """A tiny Qwen3 target with a 24-token vocabulary and a one-layer z-lab drafter on it (block
    of 4, mask id 23) under ``root``: few enough tokens to check sampled distributions exactly."""
    root = Path(root)
    target = make_tiny_qwen3_target(root / "target", seed=0, vocab_size=24)
    draft = make_zlab_drafter(root / "draft", target, seed=0, num_layers=1, block_size=4, mask_token_id=23)
    return target, draft
