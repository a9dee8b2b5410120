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
* ``routing``: the router GEMV + top-k: fixed expert ids (0..k-1 plus the shared expert).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from laguna_dflash.kernels import moe_routing, paged_attention, qk_norm_rope_cache
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


_FIXED_ROUTES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _routing(original):
    def route(x, weight, bias, top_k, *args, scale=1.0, num_shared=0):
        key = (x.shape[0], top_k, num_shared, x.device, x.dtype, weight.shape[0])
        if key not in _FIXED_ROUTES:  # made in the eager warm-up, before the capture
            k = top_k + num_shared
            ids = torch.arange(k, device=x.device).repeat(x.shape[0], 1)
            if num_shared:
                ids[:, top_k:] = weight.shape[0]  # the folded shared expert's id is E
            _FIXED_ROUTES[key] = (torch.full((x.shape[0], k), 1.0 / k, device=x.device, dtype=x.dtype), ids)
        return _FIXED_ROUTES[key]
    return route


ABLATIONS: dict[str, tuple[object, str, Callable]] = {
    "post_norm": (fusion, "add_rms_norm", _skip_norm(2)),
    "input_norm": (fusion, "add_rms_norm", _skip_norm(3)),
    "merge": (paged_attention, "_kernels", _merge),
    "qk": (qk_norm_rope_cache, "qk_norm_rope_cache", _qk),
    "routing": (moe_routing, "fused_router_route", _routing),
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
    return undo
