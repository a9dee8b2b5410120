"""Paged KV cache: CPU-side block bookkeeping plus per-layer device tensors.

A sequence owns a list of block ids (its block table); token position ``j`` lives in slot
``block_table[j // block_size] * block_size + j % block_size``. One extra block past the
allocatable range is the scratch block: padding tokens write there and out-of-range keys read
from there (always masked), so shapes stay fixed without branches.
"""

from __future__ import annotations

import torch


class BlockAllocator:
    """Free-list allocator of fixed-size KV blocks (pure CPU bookkeeping)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Extra blocks a table of ``num_held`` blocks needs to cover ``num_tokens`` positions."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        assert num_blocks <= len(self._free), "caller must check can_allocate first"
        return [self._free.pop() for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        assert len(self._free) <= self.num_blocks, "double free of KV blocks"


class KVCache:
    """Per-layer K and V tensors ``[num_slots, num_kv_heads, head_dim]`` (slots incl. scratch)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.num_slots = (num_blocks + 1) * block_size
        self.scratch_slot = num_blocks * block_size
        self.layers = [
            (
                torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
                torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
