"""Paged KV cache: CPU-side block bookkeeping plus per-layer device tensors.

A sequence owns a list of block ids (its block table); token position ``j`` lives in slot
``block_table[j // block_size] * block_size + j % block_size``. One extra block past the
allocatable range is the scratch block: padding tokens write there and out-of-range keys read
from there (always masked), so shapes stay fixed without branches.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch


def block_hashes(token_ids: list[int], block_size: int, known: list[bytes],
                 salt: str | None = None) -> list[bytes]:
    """The content hashes of every full block of ``token_ids``: ``known`` (a prefix of the
    chain, reused) extended. Block ``i``'s hash is ``sha256(hash[i-1] | its token ids)``, so it
    names the whole prefix up to the block's end (equal hashes <=> equal token prefixes, barring
    a SHA-256 collision), as vLLM's prefix caching names blocks. ``salt`` (a request's
    ``cache_salt``) stands in for block 0's missing predecessor, so the chain names the salt
    too: equal prefixes under different salts never share a block."""
    out = list(known)
    seed = b"" if salt is None else b"cache_salt\0" + salt.encode("utf-8")
    for i in range(len(out), len(token_ids) // block_size):
        digest = hashlib.sha256(out[-1] if out else seed)
        digest.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        out.append(digest.digest())
    return out


class BlockAllocator:
    """Fixed-size KV blocks with reference counts (pure CPU bookkeeping).

    Free blocks wait in a pool, least recently freed first. With prefix caching a full block
    whose K/V is final may be :meth:`register`-ed under its :func:`block_hashes` hash; it keeps
    that content in the pool after its last reference is freed, so a later request whose prompt
    starts with the same tokens :meth:`lookup`-s and :meth:`share`-s it instead of recomputing
    it, until the pool hands it out again (eviction: the hash is forgotten). Invariant: a block
    with a hash is never written (requests write only at positions past their shared prefix).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are handed out last-freed last)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Extra blocks a table of ``num_held`` blocks needs to cover ``num_tokens`` positions."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        assert num_blocks <= len(self._free), "caller must check can_allocate first"
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._forget(block)  # its content will be overwritten
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced ones return to the pool, a table's
        last blocks first (they are evicted before its first ones, which more requests share)."""
        for block in reversed(blocks):
            assert self._refs[block] > 0, "double free of KV blocks"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    # ---- prefix caching ------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (nothing is taken)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free pool (sharing them takes them out of it)."""
        return sum(self._refs[b] == 0 for b in blocks)

    def share(self, blocks: list[int]) -> None:
        """Take one more reference to each cached block (out of the pool if it was there)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """``block`` (held, full, its K/V final) holds the prefix named ``block_hash``. A
        prefix already cached in another block keeps that block (two requests that computed the
        same prefix at once)."""
        assert self._refs[block] > 0, "only a held block's content is known"
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks keep their holders)."""
        self._hash_of.clear()
        self._block_of.clear()

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]


# Most layer groups a hybrid layout may have (each SWA group is one more block table a request
# and one more metadata build a forward); past it the layout stays unified.
MAX_KV_GROUPS = 8


@dataclass(frozen=True)
class HybridLayout:
    """Sliding-window layers' KV reclaimed outside the window (vLLM's hybrid KV cache manager).

    The target's layers form groups of ``group_size`` layers, all of one kind: group 0 the
    full-attention layers, groups ``1 ..`` the sliding-window ones. A KV block of the shared
    pool holds ``block_size`` tokens of ``group_size`` layers, and each group gives a request its
    own block table: group 0 covers every position (as the unified layout), an SWA group only
    the blocks within ``sliding_window`` of the positions still to be computed (the rest are the
    scratch block). Layer ``i`` of every group reads and writes the same tensor: a block belongs
    to one group at a time, so the groups never share a slot. Per token of a long context the
    target keeps ``num_full`` layers' K/V instead of all of them.

    ``group_of_layer[l]``, ``index_in_group[l]``: where cache layer ``l`` lives.

    A DFlash drafter whose layers all slide (Laguna's: window 512) may keep its context K/V in
    one more SWA group, ``draft_group`` (:meth:`with_drafter`): its ``num_draft_layers`` layers
    are pool entries ``0 ..``, and its block table is that group's; else (0) the drafter keeps
    a cache of its own, indexed by the full group's table (every position).
    """

    group_size: int
    group_of_layer: tuple[int, ...]
    index_in_group: tuple[int, ...]
    sliding_window: int  # the largest window of the SWA layers: blocks before it are freed
    draft_group: int = 0
    num_draft_layers: int = 0

    @property
    def num_swa_groups(self) -> int:
        return max(max(self.group_of_layer), self.draft_group)

    def with_drafter(self, windows: list[int | None]) -> HybridLayout:
        """This layout with a drafter of layers of these sliding windows in a group of its own,
        or this layout unchanged where that does not apply: a drafter layer without a window
        (full attention reads every position), more drafter layers than a group holds, or no
        group left under ``MAX_KV_GROUPS``. The window kept becomes the largest of both models'
        (the drafter's block at ``P ..`` reads context keys ``> P - window``)."""
        if (not windows or any(w is None for w in windows) or len(windows) > self.group_size
                or self.num_swa_groups + 2 > MAX_KV_GROUPS):
            return self
        return dataclasses.replace(self, sliding_window=max(self.sliding_window, *windows),
                                   draft_group=self.num_swa_groups + 1, num_draft_layers=len(windows))

    @staticmethod
    def for_layers(windows: list[int | None]) -> HybridLayout | None:
        """The layout of target layers with these sliding windows (None: full attention), or
        None where it does not apply: no sliding or no full layer, a sliding layer count that
        is not a multiple of the full one (groups must be equal), or more than
        ``MAX_KV_GROUPS`` groups. Laguna XS-2.1: 10 full + 3 x 10 sliding; S-2.1: 12 + 3 x 12."""
        full = [i for i, w in enumerate(windows) if w is None]
        swa = [i for i, w in enumerate(windows) if w is not None]
        if not full or not swa or len(swa) % len(full) or 1 + len(swa) // len(full) > MAX_KV_GROUPS:
            return None
        size = len(full)
        group, index = [0] * len(windows), [0] * len(windows)
        for j, layer in enumerate(full):
            index[layer] = j
        for j, layer in enumerate(swa):
            group[layer], index[layer] = 1 + j // size, j % size
        return HybridLayout(size, tuple(group), tuple(index), max(w for w in windows if w is not None))


class KVCache:
    """Per-layer K and V tensors ``[num_slots, num_kv_heads, head_dim]`` (slots incl. scratch).

    With a :class:`HybridLayout` the layers are views of ``group_size`` pooled tensors: layer
    ``l`` is pool entry ``index_in_group[l]``, shared by the layers of that index in every group.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: HybridLayout | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_slots = (num_blocks + 1) * block_size
        self.scratch_slot = num_blocks * block_size
        self.layout = layout
        num_tensors = layout.group_size if layout is not None else num_layers
        self.pool = [
            (
                torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
                torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
            )
            for _ in range(num_tensors)
        ]
        self.layers = self.pool if layout is None else [self.pool[i] for i in layout.index_in_group]
        # each layer's group (engine/runner, cuda_graph: which block table's metadata it takes)
        self.group_of_layer = layout.group_of_layer if layout is not None else ()
        # the group whose table holds the drafter's context K/V (HybridLayout.draft_group; 0:
        # the full group's, the drafter's own cache shares its slot index space)
        self.draft_group = layout.draft_group if layout is not None else 0

    def drafter_view(self) -> KVCache:
        """The drafter's cache in the layout's drafter group: its layers are pool entries
        ``0 .. num_draft_layers - 1`` (a block of the group holds them; the rest of the block's
        entries stay unused), same slots and scratch slot; one block table, the group's."""
        assert self.layout is not None and self.layout.draft_group, "the layout has no drafter group"
        view = copy.copy(self)
        view.layers = self.pool[: self.layout.num_draft_layers]
        view.layout, view.group_of_layer, view.draft_group = None, (), 0
        return view

    @staticmethod
    def num_bytes(*caches: KVCache) -> int:
        """Device bytes of the distinct tensors behind ``caches``' layers: a hybrid layout's
        pooled layers, and a drafter view of the pool (:meth:`drafter_view`), counted once."""
        tensors = {t.data_ptr(): t for cache in caches for layer in cache.layers for t in layer}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
