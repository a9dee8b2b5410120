"""Triton paged-attention backend: :class:`TorchSDPABackend` semantics, read from the paged cache.

``TritonPagedBackend.attend`` hands the per-forward index tensors of :class:`AttentionMetadata`
straight to :func:`laguna_dflash.kernels.paged_attention.paged_attention`:

* ``query_index [R, Qmax]`` / ``query_positions [R, Qmax]``: which flat token each padded query
  is, and its position (``-1`` marks padding). The kernel loads queries through ``query_index``
  and writes each result to its flat row, so ``flat_index`` is not needed (no padded output).
* ``key_slots [R, Lmax]``: the slot of key position ``j``, i.e. the block table already expanded
  per key (``table[j // block_size] * block_size + j % block_size``); the kernel reads one slot
  per key and gathers that key's ``[head_dim]`` row of its KV head. No block table and no start
  position are needed: positions come from ``query_positions`` and visibility from ``seq_lens``.
* ``seq_lens [R]`` and ``is_causal``: the mask rule of ``AttentionMetadata.mask``, applied per
  tile on the device (no mask tensor is built).

Nothing here reads device values on the host, and the launch grid depends only on the shapes of
these tensors, so a forward through this backend can be captured in a CUDA graph once the
metadata lives in persistent buffers.

Where the kernel cannot run (a CPU without ``TRITON_INTERPRET=1``, no triton, a pre-Ampere GPU)
``attend`` falls back to the torch SDPA reference, like the other kernels' hooks.
"""

from __future__ import annotations

import torch

from ..kernels import batch_invariant
from ..kernels import paged_attention as pa
from ..models import layers
from . import attention
from .attention import AttentionBackend, AttentionMetadata, TorchSDPABackend

# Eager forwards (outside a CUDA-graph build) that split the keys take a fixed split count
# (``paged_attention(fixed_splits=True)``): with a count that followed the key length an eager
# decode built new attention and merge variants every 64 keys as its context grew (H200, XS-2.1
# size: ~3 s steps at 800 and 1600 keys; docs/PERFORMANCE.md, forty-second pass). The graphed
# forwards keep the count of their key bucket. False: the count follows the keys (A/B switch).
fixed_eager_splits = True


class TritonPagedBackend(AttentionBackend):
    """Paged attention in one Triton launch per layer (two with split-K).

    ``num_splits`` / ``block_n`` override the kernel's launch choices (tests, tuning); ``None``
    lets :func:`~laguna_dflash.kernels.paged_attention.paged_attention` pick from the shapes.
    """

    name = "triton"

    def __init__(self, *, num_splits: int | None = None, block_n: int | None = None) -> None:
        self.num_splits = num_splits
        self.block_n = block_n
        self.fallback: AttentionBackend = TorchSDPABackend()

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

        Same semantics as :meth:`TorchSDPABackend.attend`: mask ``AttentionMetadata.mask(
        sliding_window, is_causal)``, sinks as an extra per-head logit in the denominator,
        ``is_causal=None`` takes ``meta.is_causal``. A per-head ``gate [T, num_heads]`` is applied
        in the kernel's store; a per-element one afterwards. ``prefetch`` (a weight) is brought
        into L2 by the attention programs on sm90+ (kernels/l2_prefetch.py); ``early_signal`` lets
        the launch after the merge start early (kernels/paged_attention.py). Inside
        :func:`~laguna_dflash.kernels.batch_invariant.scope` the kernel runs its one
        batch-invariant configuration (and never falls back to SDPA).
        """
        invariant = batch_invariant.is_active()
        if not pa.is_available(q.device):
            if invariant:
                raise ValueError(f"batch-invariant attention needs the Triton kernels, which cannot "
                                 f"run on {q.device}; use a CUDA GPU (sm80+) or drop batch_invariant")
            return self.fallback.attend(q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window,
                                        sinks=sinks, is_causal=is_causal, gate=gate)
        causal = meta.is_causal if is_causal is None else is_causal
        per_head = gate is not None and gate.dim() == 2
        out = pa.paged_attention(
            q, k_cache, v_cache, meta.query_index, meta.query_positions, meta.key_slots,
            meta.seq_lens, scale=scale, causal=causal, sliding_window=sliding_window, sinks=sinks,
            num_splits=self.num_splits, block_n=self.block_n, gate=gate if per_head else None,
            prefetch=prefetch, early_signal=early_signal, batch_invariant=invariant,
            fixed_splits=fixed_eager_splits and not layers.is_building_cuda_graph(),
        )
        return out if per_head else attention.apply_output_gate(out, gate)


def register() -> None:
    """Make ``get_attention_backend("triton")`` return a :class:`TritonPagedBackend` (not the
    default: ``auto`` stays the torch SDPA reference)."""
    attention._BACKENDS.setdefault(TritonPagedBackend.name, TritonPagedBackend)
