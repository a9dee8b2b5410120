"""Attention backends for training: the inference modules run unchanged on dense batches.

``Attention.forward`` writes K/V through the backend and then attends through it. For training
there is no paged cache: :class:`DenseTrainingBackend` keeps this layer's K/V and attends over
the same ``[B, T]`` sequences (causal / sliding per layer); :class:`BlockTrainingBackend` lets
DFlash blocks attend to precomputed context K/V (passed as the layer's "cache") plus the
block's own K/V, under the training mask of reference/dflash.md section 6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.attention import AttentionBackend, AttentionMetadata, apply_output_gate


def dense_metadata(batch: int, seq_len: int, device: torch.device) -> AttentionMetadata:
    """Metadata for ``batch`` sequences of ``seq_len`` tokens at positions ``0..seq_len-1``."""
    pos = torch.arange(seq_len, device=device)
    flat = torch.arange(batch * seq_len, device=device)
    return AttentionMetadata(
        positions=pos.repeat(batch), slot_mapping=flat, flat_index=flat,
        query_index=flat.view(batch, seq_len), query_positions=pos.expand(batch, seq_len),
        key_slots=flat.view(batch, seq_len), seq_lens=torch.full((batch,), seq_len, device=device),
    )


class DenseTrainingBackend(AttentionBackend):
    """Self-attention over the forward's own tokens (no cache). Call sequence per layer is
    ``write_kv`` then ``attend``, so the K/V of the current layer are held in between."""

    name = "dense_training"

    def __init__(self) -> None:
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def write_kv(self, k_cache, v_cache, k, v, meta) -> None:
        self._kv = (k, v)

    def attend(self, q, k_cache, v_cache, meta, *, scale, sliding_window=None, sinks=None,
               is_causal=None, gate=None, prefetch=None, early_signal=False) -> torch.Tensor:
        if sinks is not None:
            raise NotImplementedError("training with attention sinks is not supported")
        k, v = self._kv
        b, t = meta.query_index.shape
        qp = q.view(b, t, *q.shape[1:]).transpose(1, 2)
        kp = k.view(b, t, *k.shape[1:]).transpose(1, 2)
        vp = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        causal = meta.is_causal if is_causal is None else is_causal
        if causal and sliding_window is None:
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask(sliding_window, causal),
                                                 scale=scale, enable_gqa=True)
        return apply_output_gate(out.transpose(1, 2).reshape(b * t, *q.shape[1:]), gate)


class BlockTrainingBackend(AttentionBackend):
    """DFlash training attention: ``B`` sequences, each with ``T`` context rows and ``N`` blocks
    of ``S`` slots (anchors ``a_j``). Query (block j, slot s) at position ``a_j + s`` sees

    * context key ``p`` iff ``p < a_j`` (the anchor's own hidden state is not visible, as at
      inference where the bonus token has none yet), and, on windowed layers, ``p > a_j + s - W``;
    * block key (j', s') iff ``j' == j`` (and ``s' <= s`` on causal layers).

    The layer "cache" passed to ``attend`` is the precomputed context K/V ``[B*T, kvh, hd]``.
    """

    name = "block_training"

    def __init__(self, anchors: torch.Tensor, context_len: int, block_size: int) -> None:
        self.anchors = anchors  # [B, N] int64
        self.context_len = context_len
        self.block_size = block_size
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._masks: dict = {}

    def mask(self, sliding_window: int | None, causal: bool) -> torch.Tensor:
        key = (sliding_window, causal)
        if key in self._masks:
            return self._masks[key]
        b, n = self.anchors.shape
        s = self.block_size
        dev = self.anchors.device
        slot = torch.arange(s, device=dev)
        qpos = (self.anchors.unsqueeze(-1) + slot).view(b, n * s, 1)  # [B, NQ, 1]
        anchor_of_q = self.anchors.repeat_interleave(s, dim=1).unsqueeze(-1)  # [B, NQ, 1]
        p = torch.arange(self.context_len, device=dev).view(1, 1, -1)
        ctx = p < anchor_of_q
        if sliding_window is not None:
            ctx = ctx & (p > qpos - sliding_window)
        qblock = torch.arange(n * s, device=dev) // s
        same = qblock.view(-1, 1) == qblock.view(1, -1)
        if causal:
            same = same & (torch.arange(n * s, device=dev).view(1, -1) <= torch.arange(n * s, device=dev).view(-1, 1))
        blk = same.unsqueeze(0).expand(b, -1, -1)
        mask = torch.cat([ctx, blk], dim=-1).unsqueeze(1)  # [B, 1, NQ, T + NQ]
        self._masks[key] = mask
        return mask

    def write_kv(self, k_cache, v_cache, k, v, meta) -> None:
        self._kv = (k, v)

    def attend(self, q, k_cache, v_cache, meta, *, scale, sliding_window=None, sinks=None,
               is_causal=None, gate=None, prefetch=None, early_signal=False) -> torch.Tensor:
        k, v = self._kv
        b = self.anchors.shape[0]
        nq = q.shape[0] // b

        def heads_first(x: torch.Tensor, rows: int) -> torch.Tensor:
            return x.view(b, rows, *x.shape[1:]).transpose(1, 2)

        kp = torch.cat([heads_first(k_cache, self.context_len), heads_first(k, nq)], dim=2)
        vp = torch.cat([heads_first(v_cache, self.context_len), heads_first(v, nq)], dim=2)
        causal = meta.is_causal if is_causal is None else is_causal
        out = F.scaled_dot_product_attention(heads_first(q, nq), kp, vp, scale=scale, enable_gqa=True,
                                             attn_mask=self.mask(sliding_window, causal))
        return apply_output_gate(out.transpose(1, 2).reshape(b * nq, *q.shape[1:]), gate)
