"""Attention over the paged KV cache, behind a small backend interface.

Layout. A forward runs ``T`` flat query tokens from ``R`` requests. Each layer owns two cache
tensors ``[num_slots, num_kv_heads, head_dim]``; slot ``= block_id * block_size + offset``. The
key at index ``j`` of request ``r`` is the token at absolute position ``j`` of that request, found
at ``key_slots[r, j]``. All per-forward index tensors are built once by the runner
(:class:`AttentionMetadata`) and shared by every layer; masks are derived on the device from
positions, so nothing here synchronises with the host.

Mask rule, for query position ``p`` and key position ``j`` of the same request:
``j < seq_len`` and (``j <= p`` if causal) and (``j > p - W`` if the layer has window ``W``: the
window includes the current token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-forward attention metadata (all tensors on the model's device).

    positions:       [T] int64, absolute position of each flat query token.
    slot_mapping:    [T] int64, cache slot each query token's K/V is written to (padding rows
                     point at the scratch slot).
    flat_index:      [T] int64, row of each flat token in the padded ``[R * Qmax]`` layout.
    query_index:     [R, Qmax] int64, flat token of each padded query (padding -> 0).
    query_positions: [R, Qmax] int64, absolute position of each padded query (padding -> -1).
    key_slots:       [R, Lmax] int64, cache slot of key position j (beyond the sequence ->
                     scratch slot).
    seq_lens:        [R] int64, number of visible keys (context + this forward's tokens).
    is_causal:       causal inside the new tokens (targets) or bidirectional (DFlash block).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    flat_index: torch.Tensor
    query_index: torch.Tensor
    query_positions: torch.Tensor
    key_slots: torch.Tensor
    seq_lens: torch.Tensor
    is_causal: bool = True
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def mask(self, sliding_window: int | None, is_causal: bool | None = None) -> torch.Tensor:
        """Boolean mask ``[R, 1, Qmax, Lmax]`` (True = attend), cached per (window, causality).

        ``is_causal=None`` uses the forward's default. A bidirectional windowed layer (DFlash
        ``use_swa``) sees keys with ``|p - j| < W``.
        """
        causal = self.is_causal if is_causal is None else is_causal
        key = (sliding_window, causal)
        if key in self._masks:
            return self._masks[key]
        lmax = self.key_slots.shape[1]
        j = torch.arange(lmax, device=self.key_slots.device).view(1, 1, lmax)
        p = self.query_positions.unsqueeze(-1)  # [R, Qmax, 1]
        allowed = j < self.seq_lens.view(-1, 1, 1)
        if causal:
            allowed = allowed & (j <= p)
        if sliding_window is not None:
            allowed = allowed & (j > p - sliding_window)
            if not causal:
                allowed = allowed & (j < p + sliding_window)
        # Padding queries (p < 0) attend to key 0 only so the softmax stays finite; their output
        # is never read.
        allowed = allowed | ((p < 0) & (j == 0))
        mask = allowed.unsqueeze(1)
        self._masks[key] = mask
        return mask


class AttentionBackend:
    """Interface: write this forward's K/V into the cache, then attend over the cache."""

    name = "base"

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store ``k, v [T, num_kv_heads, head_dim]`` at ``meta.slot_mapping``."""
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        is_causal: bool | None = None,
        gate: torch.Tensor | None = None,
        prefetch: torch.Tensor | None = None,
        early_signal: bool = False,
    ) -> torch.Tensor:
        """``q [T, num_heads, head_dim]`` -> ``[T, num_heads, head_dim]`` in q's dtype.

        ``gate``: output-gate logits ``[T, num_heads]`` (per head) or ``[T, num_heads, head_dim]``
        (per element); the output is multiplied by ``softplus(gate)`` (:func:`apply_output_gate`).
        ``prefetch``: a weight the next kernel reads (``o_proj``'s); a backend may bring it into
        L2 while it attends (kernels/l2_prefetch.py). ``early_signal``: the next launch reads
        only weights before its PDL wait, so a backend may let it start early
        (kernels/paged_attention.py). Both are hints: no value changes, and backends that
        cannot use them ignore them.
        """
        raise NotImplementedError


class TorchSDPABackend(AttentionBackend):
    """Reference backend: gather the visible K/V into a padded batch and call SDPA.

    ``sinks [num_heads]`` (gpt-oss style) add one logit per head that enters only the softmax
    denominator: ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij'))``. It is realised as an
    extra key column with a zero key (logit 0), zero value and an additive bias ``sink_h``.
    """

    name = "torch_sdpa"

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        is_causal: bool | None = None,
        gate: torch.Tensor | None = None,
        prefetch: torch.Tensor | None = None,
        early_signal: bool = False,
    ) -> torch.Tensor:
        """Same contract as :meth:`AttentionBackend.attend` (the hints ignored)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        r, qmax = meta.query_index.shape
        qp = q[meta.query_index].transpose(1, 2)  # [R, H, Qmax, D]
        kp = k_cache[meta.key_slots].to(q.dtype).transpose(1, 2)  # [R, KVH, Lmax, D]
        vp = v_cache[meta.key_slots].to(q.dtype).transpose(1, 2)
        mask = meta.mask(sliding_window, is_causal)
        if sinks is None:
            out = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:
            kvh = kp.shape[1]
            zeros = kp.new_zeros(r, kvh, 1, head_dim)
            kp = torch.cat([kp, zeros], dim=2)
            vp = torch.cat([vp, zeros], dim=2)
            bias = torch.zeros(r, num_heads, qmax, mask.shape[-1] + 1, dtype=q.dtype, device=q.device)
            bias[..., :-1].masked_fill_(~mask, float("-inf"))
            bias[..., -1] = sinks.to(q.dtype).view(1, num_heads, 1)
            out = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=bias, scale=scale, enable_gqa=True
            )
        out = out.transpose(1, 2).reshape(r * qmax, num_heads, head_dim)
        return apply_output_gate(out[meta.flat_index], gate)


def apply_output_gate(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``out [T, nh, hd]`` times ``softplus(gate)`` (fp32 softplus rounded to out's dtype; Laguna's
    attention output gate); ``gate`` ``[T, nh]`` per head or ``[T, nh, hd]`` per element."""
    if gate is None:
        return out
    from ..models import fusion  # the models import this module

    return fusion.softplus_gate(out, gate.unsqueeze(-1) if gate.dim() == 2 else gate.view_as(out))


_BACKENDS = {"torch_sdpa": TorchSDPABackend}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` (the paged kernels, engine/triton_attention.py) on a GPU that
    runs Triton, else ``torch_sdpa``; other names unchanged."""
    if name != "auto":
        return name
    from ..kernels.availability import triton_can_run

    return "triton" if device.type == "cuda" and triton_can_run(device, min_major=8) else "torch_sdpa"


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """Return a backend by name; ``auto`` picks the torch SDPA reference (the engine resolves
    ``auto`` per device first: :func:`resolve_backend_name`). ``triton`` is the paged Triton
    backend (engine/triton_attention.py)."""
    if name == "auto":
        name = "torch_sdpa"
    if name == "triton":
        from .triton_attention import register  # lazy: triton_attention imports this module

        register()
    if name not in _BACKENDS:
        available = ", ".join(sorted({*_BACKENDS, "triton", "auto"}))
        raise ValueError(f"attention backend {name!r} is unknown; available: {available}")
    return _BACKENDS[name]()
