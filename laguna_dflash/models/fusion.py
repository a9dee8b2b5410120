"""One kernel per elementwise chain: ``torch.compile`` of a layer's pure-tensor functions on CUDA.

Under CUDA graphs a decode step has no launch overhead left, but every kernel still costs a few
microseconds of GPU time however little it computes. Eagerly, a Laguna layer runs ~85 kernels
per forward, most of them tiny: an fp32 RMSNorm is seven (cast, square, mean, add, rsqrt, two
multiplies and a cast back), a partial RoPE about ten. At batch 1 those dominate the step
(docs/PERFORMANCE.md). The functions below are the bodies of those chains; :func:`fused` runs
each through ``torch.compile`` (Inductor emits one Triton kernel per chain) for CUDA tensors in
inference, and the eager body everywhere else (CPU, training), which stays the reference the
tests compare against.

Compilation happens on the first CUDA call of each variant, i.e. in prefill or in the eager
warm-up before a CUDA graph is captured, never inside a capture. The forwards recorded into
throwaway graphs to build Triton kernels ahead (``kernels.precompile.is_build_only``) take the
eager body: compiling there would fail inside the recording. If compiling fails the error is
logged once and the eager body is used from then on. ``enabled = False`` turns fusion off.
The residual add + RMSNorm chains (:func:`rms_norm`, :func:`add_rms_norm`, :func:`add`) take the
Triton kernel of kernels/add_rms_norm.py instead where it runs (:data:`use_norm_kernel`), and
:func:`silu_mul` the one of kernels/silu_mul.py (:data:`use_silu_kernel`); :func:`embedding`,
not a chain, the PDL gather of kernels/embedding.py (:data:`use_embedding_kernel`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F

from ..kernels import add_rms_norm as norm_kernel
from ..kernels import embedding as embedding_kernel
from ..kernels import precompile
from ..kernels import silu_mul as silu_kernel

logger = logging.getLogger(__name__)

enabled = True
# CUDA inference: the residual add + RMSNorm chains (rms_norm, add_rms_norm, add on [T, H] rows)
# through the Triton kernel of kernels/add_rms_norm.py, which takes part in programmatic
# dependent launch, instead of torch.compile's kernels, which are normal launches (two pipeline
# drains per layer in a PDL graph). Same math; False: torch.compile (an A/B switch).
use_norm_kernel = True
# CUDA inference: the dense MLPs' SwiGLU (silu_mul) through the PDL-capable Triton kernel of
# kernels/silu_mul.py instead of a torch.compile'd normal launch between the gate|up and down
# GEMMs. Same math (rounded as eager rounds); False: torch.compile (an A/B switch). On the H200
# the drafter block's graph replayed in 0.34 against 0.35 ms and the DFlash K = 3 step in 4.33
# against 4.38 ms (docs/PERFORMANCE.md, fifty-ninth pass).
use_silu_kernel = True
# CUDA inference: the token embedding gather through the PDL-capable Triton kernel of
# kernels/embedding.py instead of torch's gather, a normal launch ahead of layer 0's PDL chain.
# A copy either way; False: F.embedding (an A/B switch).
use_embedding_kernel = True

Fn = TypeVar("Fn", bound=Callable)


def fused(fn: Fn) -> Fn:
    """Wrap ``fn`` (first argument a tensor): compiled on CUDA in inference, eager otherwise."""
    compiled: Callable | None = None
    broken = False

    @functools.wraps(fn)
    def wrapper(*args):
        nonlocal compiled, broken
        if (not enabled or broken or not args[0].is_cuda or torch.is_grad_enabled()
                or precompile.is_build_only()):  # a recording that never runs: compile later
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, keep serving
            broken = True
            logger.warning("torch.compile of %s failed, running it eagerly: %s", fn.__name__, e)
            return fn(*args)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, statistics in fp32, result in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _norm_kernel_runs(h: torch.Tensor, delta: torch.Tensor | None,
                      weight: torch.Tensor | None) -> bool:
    return (use_norm_kernel and enabled and h.is_cuda and not torch.is_grad_enabled()
            and norm_kernel.can_run(h, delta, weight))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; statistics in fp32, normalised
    value cast back to x's dtype before the weight (as the references do)."""
    return weight * rms_normalize(x, eps)


_rms_norm_fused = fused(_rms_norm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`_rms_norm`: the Triton kernel where it runs (:data:`use_norm_kernel`), else one
    torch.compile'd kernel on CUDA, eager elsewhere."""
    if _norm_kernel_runs(x, None, weight):
        return norm_kernel.add_rms_norm(x, None, weight, eps)[1]
    return _rms_norm_fused(x, weight, eps)


rms_norm.eager = _rms_norm  # type: ignore[attr-defined]


_rms_norm_unweighted_fused = fused(rms_normalize)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_normalize` of ``x [T, H]`` as one kernel (the drafter's shared context
    statistic): the Triton kernel where it runs (:data:`use_norm_kernel`), else torch.compile's
    on CUDA, eager elsewhere."""
    if _norm_kernel_runs(x, None, None):
        return norm_kernel.add_rms_norm(x, None, None, eps, unit_weight=True)[1]
    return _rms_norm_unweighted_fused(x, eps)


rms_norm_unweighted.eager = rms_normalize  # type: ignore[attr-defined]


def _rms_norm_interleaved(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, G * H]`` as G groups of H per row, group ``j`` RMS-normed with ``weight[j]``
    (``weight [G, H]``) -> ``[T, G * H]``: the DFlash taps' per-tap norms, concatenated."""
    g, hidden = weight.shape
    y = weight * rms_normalize(x.view(x.shape[0], g, hidden), eps)
    return y.reshape(x.shape[0], g * hidden)


_rms_norm_interleaved_fused = fused(_rms_norm_interleaved)


def rms_norm_interleaved(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`_rms_norm_interleaved` as one kernel: the Triton kernel (each ``[H]`` slice of a
    row a row of its own, weight row ``r % G`` for slice ``r``) where it runs
    (:data:`use_norm_kernel`), else torch.compile's on CUDA, eager elsewhere."""
    if x.dim() == 2 and weight.dim() == 2 and x.shape[-1] == weight.numel() and x.is_contiguous():
        rows = x.view(-1, weight.shape[1])
        if _norm_kernel_runs(rows, None, weight):
            return norm_kernel.add_rms_norm(rows, None, weight, eps)[1].view(x.shape)
    return _rms_norm_interleaved_fused(x, weight, eps)


rms_norm_interleaved.eager = _rms_norm_interleaved  # type: ignore[attr-defined]


@fused
def rms_norm_grouped(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [G, ..., D]`` with one weight row per group ``[G, D]``."""
    w = weight.view(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[1])
    return w * rms_normalize(x, eps)


def _add(h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``h [T, H]`` plus ``delta``: ``[T, H]`` (one bf16/fp32 add, as the references do) or the
    fused MoE's pairs ``[T, P, H]``, summed over ``P`` in fp32 with ``h`` and rounded once. The
    pairs are added one by one (P is small and static per graph), which Inductor keeps in the
    same kernel as what follows (a reduction over P would be a kernel of its own)."""
    if delta.dim() == h.dim():
        return h + delta
    out = h.float()
    for p in range(delta.shape[1]):
        out = out + delta[:, p].float()
    return out.to(h.dtype)


def _add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``(h + delta, rms_norm(h + delta))``, ``[T, H]`` each;
    ``delta`` may be MoE pairs ``[T, P, H]`` (:func:`_add`)."""
    h = _add(h, delta)
    return h, weight * rms_normalize(h, eps)


def _add_only(h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """:func:`_add` as one kernel: the residual stream after a layer whose add was deferred."""
    return _add(h, delta)


_add_rms_norm_fused = fused(_add_rms_norm)
_add_fused = fused(_add_only)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_add_rms_norm` as one kernel (dispatched as :func:`rms_norm`)."""
    if _norm_kernel_runs(h, delta, weight):
        return norm_kernel.add_rms_norm(h, delta, weight, eps)
    return _add_rms_norm_fused(h, delta, weight, eps)


def add(h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """:func:`_add` as one kernel (dispatched as :func:`rms_norm`): the residual stream after a
    layer whose add was deferred."""
    if _norm_kernel_runs(h, delta, None):
        return norm_kernel.add_rms_norm(h, delta, None, 0.0)[0]
    return _add_fused(h, delta)


add_rms_norm.eager = _add_rms_norm  # type: ignore[attr-defined]
add.eager = _add_only  # type: ignore[attr-defined]


def _rope(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
          positions: torch.Tensor, rot: int) -> torch.Tensor:
    cos = cos_table[positions].unsqueeze(1).to(x.dtype)
    sin = sin_table[positions].unsqueeze(1).to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


@fused
def rope(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
         positions: torch.Tensor, rot: int) -> torch.Tensor:
    """Rotate the first ``rot`` dims of ``x [N, heads, head_dim]`` at ``positions [N]`` (NeoX
    halves); tables ``[max_pos, rot]`` fp32, cast to x's dtype."""
    return _rope(x, cos_table, sin_table, positions, rot)


@fused
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, positions: torch.Tensor, rot: int) -> torch.Tensor:
    """Per-head RMSNorm then RoPE (the Q/K path of an attention layer) in one kernel."""
    return _rope(weight * rms_normalize(x, eps), cos_table, sin_table, positions, rot)


@fused
def softplus_gate(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """``out [T, nh, hd]`` times ``softplus(gate_logits)`` (fp32 softplus, cast to out's dtype);
    ``gate_logits`` is ``[T, nh, 1]`` (per head) or ``[T, nh, hd]`` (per element)."""
    return out * F.softplus(gate_logits.float()).to(out.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of ``gate_up [T, 2I]`` (gate half first) -> ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_silu_mul_fused = fused(_silu_mul)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`_silu_mul`: the Triton kernel of kernels/silu_mul.py where it runs
    (:data:`use_silu_kernel`), else one torch.compile'd kernel on CUDA, eager elsewhere."""
    if (use_silu_kernel and enabled and gate_up.is_cuda and not torch.is_grad_enabled()
            and silu_kernel.can_run(gate_up)):
        return silu_kernel.silu_mul(gate_up)
    return _silu_mul_fused(gate_up)


silu_mul.eager = _silu_mul  # type: ignore[attr-defined]


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids [T], weight [V, H]) -> [T, H]``: the Triton gather of
    kernels/embedding.py for CUDA inference where it runs (:data:`use_embedding_kernel`), else
    torch's."""
    if (use_embedding_kernel and enabled and weight.is_cuda and not torch.is_grad_enabled()
            and embedding_kernel.can_run(ids, weight)):
        return embedding_kernel.embedding(ids, weight)
    return F.embedding(ids, weight)


@fused
def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, softcap: float,
              score_func: str, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, k]`` in the logits' dtype, ids ``[T, k]``).

    ``s = sigmoid(z)`` (or ``sqrt(softplus(z))``), ``z`` the (soft-capped) logits in fp32;
    experts by ``topk(s + bias)``, weighted by the unbiased ``s``, renormalised when asked.
    """
    z = logits.float()
    if softcap > 0:
        z = torch.tanh(z / softcap) * softcap
    scores = torch.sigmoid(z) if score_func == "sigmoid" else torch.sqrt(F.softplus(z))
    _, ids = torch.topk(scores + bias.float(), top_k, dim=-1)
    weights = scores.gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


@fused
def scale_add(x: torch.Tensor, scale: float, y: torch.Tensor) -> torch.Tensor:
    """``x * scale + y``."""
    return x * scale + y
