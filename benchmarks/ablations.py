"""Timing-only ablations of the decode step: a latency-bound kernel removed from the chain.

Each ablation replaces one step of a layer with nothing (no launch), so the kernels after it
depend directly on the kernels before it. The output is WRONG by construction (greedy tokens
change); what it measures is an upper bound: how much shorter the step could be if that step's
work cost nothing on the chain, whatever fusion or persistent kernel took it over. Used by
``profile_decode_xs.py --ablate NAME[+NAME...]``.

* ``post_norm``: the post-attention residual add + RMSNorm: the MLP reads the attention output.
* ``input_norm``: each layer's input residual add + RMSNorm of the MoE pairs: the next layer
  reads the residual stream as it was (the MoE output is dropped).
* ``merge``: the attention split merge: o_proj reads the (unwritten) merged output buffer.
* ``qk``: the Q/K RMSNorm + RoPE + K/V cache write: attention reads q straight from the
  Q|K|V|gate GEMV's output.
* ``routing``: the router GEMV + top-k: fixed expert ids (0..k-1 plus the shared expert for
  one token; each further token the next k experts, so a verify reads as many experts).
* ``routing_spread``, ``routing_fixed_ops``, ``routing_moving``: the same, with ids spread over
  the experts, or ids 0..k-1 set by three small launches a layer that either keep them or move
  them by k experts at every call (``_moving_routing``).
* ``routing_recorded``: each layer's real routes from its first call (the capture's eager
  warm-up), replayed with no router launch; ``routing_dropped``: the router runs, its routes replaced by ids 0..k-1
  (``_recorded_routing``); ``routing_copied``: the router's routes through a copy.

The routing ablations keep route tensors from call to call, in one cache registered with the
engine's first-use state (``kernels.precompile.register_state``), as the router's own workspace
is. The engine records each forward into a throwaway CUDA graph before its capture, to build the
Triton kernels ahead; tensors made there are never written (nothing runs), and the build pass
drops what the registered caches gained, so the capture's eager warm-up makes them anew. Before
they were registered, every fixed id read 0 inside the decode graph, all nine pairs read one
expert, and the GEMVs looked twice as fast (docs/PERFORMANCE.md, seventy-fourth pass). A route
tensor first asked for inside a real capture (no warm-up before it) raises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from laguna_dflash.kernels import moe_routing, paged_attention, precompile, qk_norm_rope_cache
from laguna_dflash.models import fusion


def _wrap(obj: object, name: str, make: Callable[[Callable], Callable]) -> Callable[[], None]:
    # replace obj.name by make(original); returns the undo
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    return lambda: setattr(obj, name, original)


def _skip_norm(delta_dim: int) -> Callable[[Callable], Callable]:
    # the add + RMSNorm whose delta has delta_dim dims returns without a launch: a sublayer's
    # output [T, H] (the post-attention norm) is passed on as the normed input; the MoE pairs
    # [T, P, H] (the next layer's input norm) are dropped
    def make(original):
        def add_rms_norm(h, delta, weight, eps):
            if delta is not None and delta.dim() == delta_dim:
                return (h, delta) if delta_dim == 2 else (h, h)
            return original(h, delta, weight, eps)
        return add_rms_norm
    return make


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _merge(original):
    return lambda interpret: (original(interpret)[0], _NoLaunch())


def _qk(original):
    def qk(qkv, num_heads, num_kv_heads, head_dim, *args):
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    return qk


# every routing ablation's route tensors, keyed by (ablation, shapes / layer); registered so a
# build-only pass drops what it put here (module docstring); emptied by each apply's undo
_ROUTE_STATE: dict[tuple, tuple[torch.Tensor, ...]] = precompile.register_state({})


def fixed_routes(x: torch.Tensor, num_experts: int, top_k: int, num_shared: int,
                  stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` 1/k in x's dtype, ids ``[T, k]`` int64): token t's routed ids
    ``t top_k + j stride`` (mod E) for j < top_k, then the folded shared expert's id E, for the
    tokens of ``x [T, H]``. Token 0 gets 0, stride, .., (top_k - 1) stride; with stride 1 the
    tokens' experts are distinct up to E / top_k tokens, so a verify-sized forward still reads
    as many experts as real (random-weight) routes do, not one token's worth."""
    n, k = x.shape[0], top_k + num_shared
    ids = torch.full((n, k), num_experts, device=x.device, dtype=torch.long)
    token = torch.arange(n, device=x.device)[:, None] * top_k
    ids[:, :top_k] = (token + torch.arange(top_k, device=x.device) * stride) % num_experts
    return torch.full((n, k), 1.0 / k, device=x.device, dtype=x.dtype), ids


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _route_state(key: tuple, x: torch.Tensor, make: Callable[[], tuple]) -> tuple:
    """The route tensors cached under ``key``, made by ``make()`` on first use. Inside a
    build-only pass (the engine's throwaway recording) they are made and then dropped by it;
    inside a real capture they would be recorded, never run, for every later graph: refused."""
    state = _ROUTE_STATE.get(key)
    if state is None:
        if _capturing(x) and not precompile.is_build_only():
            raise RuntimeError(f"ablation {key[0]!r}: its route tensors for {x.shape[0]} token(s) "
                               "would be made inside a CUDA graph capture and read as garbage by "
                               "later graphs; capture with at least one eager warm-up run "
                               "(engine.cuda_graph.num_capture_warmups >= 1)")
        state = _ROUTE_STATE[key] = make()
    return state


def _routing(original):
    def route(x, weight, bias, top_k, *args, scale=1.0, num_shared=0):
        key = ("routing", x.shape[0], top_k, num_shared, x.device, x.dtype, weight.shape[0])
        return _route_state(key, x, lambda: fixed_routes(x, weight.shape[0], top_k, num_shared))
    return route


def _moving_routing(step_experts: bool, spread: bool = False) -> Callable[[Callable], Callable]:
    # fixed-weight routes whose routed ids either stay put (``step_experts`` False) or move by k
    # experts at every call (so every layer of every step reads experts the call before did not);
    # both forms run the same three small launches a call, so they differ only in the ids.
    # ``spread`` (no launches): ids 0, E/k, 2E/k, ... every call. Together with ``routing``
    # (ids 0..k-1) they tell whether the MoE GEMVs' speed with fixed routes comes from the ids
    # being contiguous (spread slow) or the same from step to step (moving slow).
    name = "routing_spread" if spread else "routing_moving" if step_experts else "routing_fixed_ops"

    def make(original):
        def route(x, weight, bias, top_k, *args, scale=1.0, num_shared=0):
            num_experts = weight.shape[0]

            def new() -> tuple[torch.Tensor, ...]:
                stride = num_experts // top_k if spread else 1
                weights, ids = fixed_routes(x, num_experts, top_k, num_shared, stride)
                return weights, ids, ids[:, :top_k].clone(), torch.zeros((), device=x.device, dtype=torch.long)

            key = (name, x.shape[0], top_k, num_shared, x.device, x.dtype, num_experts)
            weights, ids, base, offset = _route_state(key, x, new)
            if not spread:
                offset.add_(top_k if step_experts else 0)
                torch.remainder(base + offset, num_experts, out=ids[:, :top_k])
            return weights, ids
        return route
    return make


def _recorded_routing(keep_router: bool) -> Callable[[Callable], Callable]:
    # ``keep_router`` False: each layer's routes as the router chose them on its first call
    # (the capture's eager warm-up), replayed without a router launch: real ids, fixed. True: the router runs
    # as always (its launch and PDL hand-offs unchanged) but its output is dropped for fixed ids
    # 0..k-1. Which of the two is slow tells whether the real routes' ids or the router's
    # launch make the expert GEMVs slower than with ``routing``.
    name = "routing_dropped" if keep_router else "routing_recorded"

    def make(original):
        def route(x, weight, bias, top_k, *args, scale=1.0, num_shared=0):
            key = (name, weight.data_ptr(), x.shape[0])  # one router weight a layer
            routes = original(x, weight, bias, top_k, *args, scale=scale, num_shared=num_shared) \
                if keep_router or key not in _ROUTE_STATE else None

            def new() -> tuple[torch.Tensor, torch.Tensor]:
                weights, ids = fixed_routes(x, weight.shape[0], top_k, num_shared) if keep_router else routes
                return weights.clone(), ids.clone()
            return _route_state(key, x, new)
        return route
    return make


def _copied_routing(original):
    # the router's routes as always, handed to the expert GEMVs through a copy (two small torch
    # launches): the same ids and weights, written by a kernel that is not the router
    def route(*args, **kwargs):
        weights, ids = original(*args, **kwargs)
        return weights.clone(), ids.clone()
    return route


ABLATIONS: dict[str, tuple[object, str, Callable]] = {
    "post_norm": (fusion, "add_rms_norm", _skip_norm(2)),
    "input_norm": (fusion, "add_rms_norm", _skip_norm(3)),
    "merge": (paged_attention, "_kernels", _merge),
    "qk": (qk_norm_rope_cache, "qk_norm_rope_cache", _qk),
    "routing": (moe_routing, "fused_router_route", _routing),
    "routing_spread": (moe_routing, "fused_router_route", _moving_routing(False, spread=True)),
    "routing_fixed_ops": (moe_routing, "fused_router_route", _moving_routing(False)),
    "routing_moving": (moe_routing, "fused_router_route", _moving_routing(True)),
    "routing_recorded": (moe_routing, "fused_router_route", _recorded_routing(False)),
    "routing_dropped": (moe_routing, "fused_router_route", _recorded_routing(True)),
    "routing_copied": (moe_routing, "fused_router_route", _copied_routing),
}


def apply(spec: str) -> Callable[[], None]:
    """Apply ``NAME[+NAME...]`` (keys of :data:`ABLATIONS`); returns the undo of all of them."""
    names = spec.split("+")
    for name in names:  # all checked before anything is replaced
        if name not in ABLATIONS:
            raise ValueError(f"unknown ablation {name!r}; choose from {', '.join(ABLATIONS)}")
    undos = []
    for name in names:
        obj, attr, make = ABLATIONS[name]
        undos.append(_wrap(obj, attr, make))

    def undo() -> None:
        for u in reversed(undos):
            u()
        _ROUTE_STATE.clear()
    return undo
