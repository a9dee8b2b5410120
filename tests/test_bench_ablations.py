"""benchmarks/ablations.py (the timing-only ablations of profile_decode_xs.py): each one replaces
what it names and its undo restores every original; unknown names fail with the choices."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import ablations  # noqa: E402

from laguna_dflash.kernels import moe_routing, paged_attention, qk_norm_rope_cache  # noqa: E402
from laguna_dflash.models import fusion  # noqa: E402


def _originals():
    return (fusion.add_rms_norm, paged_attention._kernels, moe_routing.fused_router_route,
            qk_norm_rope_cache.qk_norm_rope_cache)


def test_every_ablation_applies_and_undoes() -> None:
    before = _originals()
    # the routing_* variants replace the same function as "routing" (tested below)
    undo = ablations.apply("+".join(n for n in ablations.ABLATIONS if not n.startswith("routing_")))
    try:
        h, d, pairs = torch.randn(1, 8), torch.randn(1, 8), torch.randn(1, 3, 8)
        assert fusion.add_rms_norm(h, d, None, 0.0) == (h, d)  # post_norm: the MLP reads delta
        assert fusion.add_rms_norm(h, pairs, None, 0.0) == (h, h)  # input_norm: pairs dropped
        w, ids = moe_routing.fused_router_route(torch.randn(1, 8), torch.randn(16, 8), None, 4, 0.0,
                                                "sigmoid", True, scale=1.0, num_shared=1)
        assert ids.tolist() == [[0, 1, 2, 3, 16]] and torch.allclose(w, torch.full((1, 5), 0.2))
        q = qk_norm_rope_cache.qk_norm_rope_cache(torch.randn(2, 4 * 16 + 2 * 2 * 16), 4, 2, 16)
        assert q.shape == (2, 4, 16)
        assert _originals() != before
    finally:
        undo()
    assert _originals() == before


def test_fixed_routes_give_each_token_its_own_experts() -> None:
    # a 3-token forward (a verify) reads 3 tokens' experts, as real routes mostly do, not one's
    weights, ids = ablations.fixed_routes(torch.randn(3, 8), 16, 4, 1)
    assert ids.tolist() == [[0, 1, 2, 3, 16], [4, 5, 6, 7, 16], [8, 9, 10, 11, 16]]
    assert torch.allclose(weights, torch.full((3, 5), 0.2))
    assert ablations.fixed_routes(torch.randn(2, 8), 16, 4, 0, stride=4)[1].tolist() == [
        [0, 4, 8, 12], [4, 8, 12, 0]]


def test_unknown_ablation_names_the_choices() -> None:
    before = _originals()
    with pytest.raises(ValueError, match="unknown ablation 'attention'; choose from post_norm"):
        ablations.apply("routing+attention")
    assert _originals() == before  # nothing left replaced


def test_routing_variants_keep_spread_or_move_their_ids() -> None:
    x, w = torch.randn(1, 8), torch.randn(16, 8)
    seen = {}
    for name in ("routing_spread", "routing_fixed_ops", "routing_moving"):
        undo = ablations.apply(name)
        try:
            calls = [moe_routing.fused_router_route(x, w, None, 4, 0.0, "sigmoid", True, scale=1.0,
                                                    num_shared=1)[1].tolist() for _ in range(5)]
        finally:
            undo()
        seen[name] = calls
    assert seen["routing_spread"] == [[[0, 4, 8, 12, 16]]] * 5
    assert seen["routing_fixed_ops"] == [[[0, 1, 2, 3, 16]]] * 5
    # moved by k = 4 at every call, modulo the 16 experts; the shared expert's id stays 16
    assert [c[0] for c in seen["routing_moving"]] == [
        [4, 5, 6, 7, 16], [8, 9, 10, 11, 16], [12, 13, 14, 15, 16], [0, 1, 2, 3, 16], [4, 5, 6, 7, 16]]


def test_recorded_routes_replay_the_first_call_and_dropped_routes_keep_the_router() -> None:
    calls = []

    def router(x, weight, bias, top_k, *args, scale=1.0, num_shared=0):
        # a stand-in for the Triton router (the ablations wrap whatever is installed): top-k of
        # x W^T, the shared expert's id E appended
        calls.append(weight.data_ptr())
        logits = x @ weight.T
        values, ids = logits.topk(top_k, dim=-1)
        ids = torch.cat([ids, torch.full_like(ids[:, :num_shared], weight.shape[0])], dim=1)
        return torch.cat([values.softmax(-1), torch.ones_like(values[:, :num_shared])], 1), ids

    original = moe_routing.fused_router_route
    moe_routing.fused_router_route = router
    try:
        w1, w2 = torch.randn(16, 8), torch.randn(16, 8)
        x1, x2 = torch.randn(1, 8), torch.randn(1, 8)
        first = {w.data_ptr(): router(x1, w, None, 4, num_shared=1) for w in (w1, w2)}
        calls.clear()
        undo = ablations.apply("routing_recorded")
        try:
            for x in (x1, x2, x1):  # layers 1 and 2 in turn; x2 alone would route elsewhere
                for w in (w1, w2):
                    weights, ids = moe_routing.fused_router_route(x, w, None, 4, num_shared=1)
                    assert torch.equal(ids, first[w.data_ptr()][1])
                    assert torch.equal(weights, first[w.data_ptr()][0])
        finally:
            undo()
        assert calls == [w1.data_ptr(), w2.data_ptr()]  # the router ran once a layer
        calls.clear()
        undo = ablations.apply("routing_dropped")
        try:
            for _ in range(3):
                weights, ids = moe_routing.fused_router_route(x2, w1, None, 4, num_shared=1)
                assert ids.tolist() == [[0, 1, 2, 3, 16]] and torch.allclose(weights, torch.full((1, 5), 0.2))
        finally:
            undo()
        assert calls == [w1.data_ptr()] * 3  # the router still runs at every call
    finally:
        moe_routing.fused_router_route = original


def test_copied_routes_equal_the_routers_in_new_tensors() -> None:
    original = moe_routing.fused_router_route
    routes = (torch.tensor([[0.5, 0.5]]), torch.tensor([[3, 16]]))
    moe_routing.fused_router_route = lambda *a, **k: routes
    try:
        undo = ablations.apply("routing_copied")
        try:
            weights, ids = moe_routing.fused_router_route(None)
        finally:
            undo()
        assert torch.equal(weights, routes[0]) and torch.equal(ids, routes[1])
        assert weights.data_ptr() != routes[0].data_ptr() and ids.data_ptr() != routes[1].data_ptr()
    finally:
        moe_routing.fused_router_route = original


@pytest.mark.parametrize("name", ["routing", "routing_moving", "routing_recorded", "routing_dropped"])
def test_route_tensors_made_in_a_build_pass_are_dropped_and_refused_in_a_capture(name, monkeypatch) -> None:
    # the engine records each forward into a throwaway graph before capturing it: route tensors
    # made there are never written (the seventy-third pass's fixed ids all read 0), so the build
    # pass must drop them (register_state) and the capture's eager warm-up make them anew; made
    # first inside a real capture, they are refused
    from laguna_dflash.kernels import precompile

    made = []

    def router(x, weight, bias, top_k, *args, scale=1.0, num_shared=0):
        made.append(x.shape[0])
        ids = torch.cat([torch.arange(top_k).expand(x.shape[0], top_k) + 1,
                         torch.full((x.shape[0], num_shared), weight.shape[0])], 1)
        return torch.full(ids.shape, 0.5), ids

    monkeypatch.setattr(moe_routing, "fused_router_route", router)
    w, x = torch.randn(16, 8), torch.randn(2, 8)
    undo = ablations.apply(name)
    try:
        monkeypatch.setattr(ablations, "_capturing", lambda x: True)
        with precompile.launches_build_only():  # the throwaway recording
            moe_routing.fused_router_route(x, w, None, 4, num_shared=1)
            assert ablations._ROUTE_STATE
        assert not ablations._ROUTE_STATE  # dropped with the pass
        with pytest.raises(RuntimeError, match="inside a CUDA graph capture.*num_capture_warmups"):
            moe_routing.fused_router_route(x, w, None, 4, num_shared=1)
        monkeypatch.setattr(ablations, "_capturing", lambda x: False)
        first = moe_routing.fused_router_route(x, w, None, 4, num_shared=1)  # the eager warm-up
        monkeypatch.setattr(ablations, "_capturing", lambda x: True)
        again = moe_routing.fused_router_route(x, w, None, 4, num_shared=1)  # the capture: found
        assert again[1] is first[1] and (first[1][:, -1] == 16).all()
        if name == "routing_recorded":  # the router's routes from the warm-up
            assert first[1][:, 0].tolist() == [1, 1]
        else:  # each token its own four experts
            assert first[1][:, :4].flatten().unique().numel() == 8
    finally:
        undo()
    assert not ablations._ROUTE_STATE
