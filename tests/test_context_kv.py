"""Fused context-K/V precompute equals the per-layer reference, for both drafter flavours."""

from __future__ import annotations

import pytest
import torch

from laguna_dflash.models.loader import load_model
from laguna_dflash.models.random_init import write_random_pair


@pytest.fixture(scope="module")
def laguna_pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), seed=3)


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("qpair")
    target = df.make_tiny_qwen3_target(root / "target", seed=1)
    return target, df.make_zlab_drafter(root / "draft", target, seed=1, num_layers=2)


def _load(pair):
    target = load_model(pair[0])
    drafter = load_model(pair[1], target=target)
    target.prepare_rope(256, "cpu")
    drafter.prepare_rope(256, "cpu")
    return target, drafter


@pytest.mark.parametrize("flavour", ["laguna", "qwen3"])
def test_fused_precompute_matches_per_layer_loop(flavour, laguna_pair, qwen3_pair):
    target, drafter = _load(laguna_pair if flavour == "laguna" else qwen3_pair)
    assert type(drafter).__name__ == ("DFlashLaguna" if flavour == "laguna" else "DFlashDraftModel")
    g = torch.Generator().manual_seed(0)
    n = 11
    taps = torch.randn(n, len(drafter.target_layer_ids) * target.spec.hidden_size, generator=g)
    positions = torch.randint(0, 200, (n,), generator=g)
    slots = torch.randperm(64, generator=g)[:n]
    context = drafter.combine_hidden_states(taps)
    caches = [(torch.zeros(64, drafter.num_kv_heads, drafter.head_dim),
               torch.zeros(64, drafter.num_kv_heads, drafter.head_dim)) for _ in drafter.layers]
    drafter.precompute_and_store_context_kv(context, positions, slots, caches)
    reference = drafter.reference_context_kv(context, positions)
    assert len(reference) == len(caches) >= 2
    for (k_ref, v_ref), (k_cache, v_cache) in zip(reference, caches):
        torch.testing.assert_close(k_cache[slots], k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_cache[slots], v_ref, rtol=1e-5, atol=1e-5)
        # nothing else was written
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[slots] = False
        assert k_cache[untouched].abs().sum() == 0


def test_laguna_fold_is_not_a_no_op(laguna_pair):
    """The Laguna reference applies each layer's input_layernorm; with non-unit norm weights the
    Qwen3-style path (hidden_norm only) would differ, so the test above can fail."""
    target, drafter = _load(laguna_pair)
    w = drafter.layers[0].input_layernorm.weight
    assert not torch.allclose(w, torch.ones_like(w))
    context = torch.randn(5, drafter.spec.hidden_size)
    laguna_in = drafter.context_kv_input(drafter.layers[0], context)
    qwen_in = drafter.hidden_norm(context)
    assert not torch.allclose(laguna_in, qwen_in)


@pytest.mark.parametrize("flavour", ["laguna", "qwen3"])
def test_drafter_shares_target_embedding_and_head(flavour, laguna_pair, qwen3_pair):
    target, drafter = _load(laguna_pair if flavour == "laguna" else qwen3_pair)
    assert drafter.embed_weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert drafter.lm_head_weight.data_ptr() == target.lm_head_weight.data_ptr()
    names = {n for n, _ in drafter.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_laguna_combine_uses_the_stacked_tap_norms_only_while_they_are_current(laguna_pair):
    """Without autograd ``combine_hidden_states`` reads the per-tap norm weights stacked after
    loading (no stack launch in a decode graph), but only while each weight is unchanged: after
    an in-place update (an optimizer step, a reload) it stacks them anew, and with autograd the
    stack is differentiable. Each case against the per-tap formula written out."""
    _, drafter = _load(laguna_pair)
    h_t = drafter.spec.target_hidden_size
    taps = torch.randn(3, len(drafter.target_layer_ids) * h_t, generator=torch.Generator().manual_seed(1))

    def by_hand() -> torch.Tensor:
        parts = [norm(tap) for norm, tap in zip(drafter.aux_hidden_norms, taps.split(h_t, dim=-1))]
        return drafter.hidden_norm(drafter.fc(torch.cat(parts, dim=-1)))

    norms = drafter.aux_hidden_norms
    with torch.no_grad():
        assert drafter._aux_norm_weights() is drafter._aux_norm_stack
        torch.testing.assert_close(drafter.combine_hidden_states(taps), by_hand(), rtol=1e-6, atol=1e-6)
        norms[1].weight.mul_(3.0)  # in place: same storage, new version
        assert drafter._aux_norm_weights() is not drafter._aux_norm_stack
        torch.testing.assert_close(drafter._aux_norm_weights()[1], norms[1].weight)
        torch.testing.assert_close(drafter.combine_hidden_states(taps), by_hand(), rtol=1e-6, atol=1e-6)
    drafter.requires_grad_(True)
    drafter.combine_hidden_states(taps).sum().backward()
    assert norms[1].weight.grad is not None and norms[1].weight.grad.abs().sum() > 0


def test_laguna_tap_norms_loaded_under_inference_mode_are_stacked_each_call(laguna_pair):
    """Weights made under ``torch.inference_mode`` have no version counter: nothing is cached,
    so an in-place change (possible only in inference mode) is still seen."""
    _, drafter = _load(laguna_pair)
    with torch.inference_mode():
        for norm in drafter.aux_hidden_norms:
            norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
        drafter._build_context_kv_buffers()
        assert drafter._aux_norm_stack is None
        drafter.aux_hidden_norms[0].weight.mul_(2.0)
        torch.testing.assert_close(drafter._aux_norm_weights()[0], drafter.aux_hidden_norms[0].weight)
