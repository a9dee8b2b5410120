"""The attention metadata of a graphed decode-phase forward in ONE launch.

``engine/cuda_graph.py`` keeps every request's state in one device buffer, a row per request:
``[start_pos, seq_len, block table..., token ids...]`` (int64), and recomputes the attention
metadata from it inside each captured graph. As torch ops that was ~17 small kernels at the head
of every replay (aranges, the gather of the query slots, the key-slot table, the mask against
``seq_len``, a contiguous copy), ~28 us of the batch-1 decode graph's span on the H200
(``gpu_check.sh span``, docs/PERFORMANCE.md); here it is one kernel. For request ``r``, query
``i < q`` and key ``j < num_keys`` (``bs`` the KV block size, ``T`` the block table)::

    q_pos[r, i]     = start_pos[r] + i
    slots[r, i]     = T[r, q_pos // bs] * bs + q_pos % bs
    key_slots[r, j] = T[r, j // bs] * bs + j % bs     if j < seq_len[r]   else scratch_slot
    seq_lens[r]     = seq_len[r]

A hybrid KV layout gives the state one block table a KV group (the full layers', then each
sliding group's, ``table_stride`` columns apart): :func:`decode_metadata_tables` writes every
table's ``slots`` and ``key_slots`` in the same launch (grid axis 2), and ``q_pos`` / ``seq_lens``
once, as they do not depend on the table. On the H200 the graphed XS-2.1 forwards (four tables)
had four launches at their head, 1.4-2.0 us of span each (docs/PERFORMANCE.md, sixty-third pass).

Integer arithmetic only: bitwise the torch reference (:func:`decode_metadata_reference`). Grid
``(R, ceil(num_keys / BLOCK_L), num_tables)``; the programs of key chunk 0 also write the query
rows. Launched normally (no PDL): its input is the host-to-device copy of the state just before it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["decode_metadata", "decode_metadata_reference", "decode_metadata_tables",
           "decode_metadata_tables_reference", "is_available"]

BLOCK_L = 1024  # keys a program


def is_available(device: torch.device | str) -> bool:
    """Triton importable and a CUDA device, or a CPU under ``TRITON_INTERPRET=1``."""
    return triton_can_run(device)


def _decode_metadata_kernel(
    state_ptr, q_pos_ptr, slots_ptr, key_slots_ptr, seq_lens_ptr,
    stride_state, q, num_keys, scratch_slot,
    KV_BLOCK: tl.constexpr, TABLE_COL: tl.constexpr, TABLE_STRIDE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    table = tl.program_id(2)
    out_row = table * tl.num_programs(0) + r  # row of the [num_tables * R, ...] outputs
    row = state_ptr + r * stride_state
    table_ptr = row + TABLE_COL + table * TABLE_STRIDE
    start = tl.load(row)
    seq_len = tl.load(row + 1)
    j = chunk * BLOCK_L + tl.arange(0, BLOCK_L)
    in_keys = j < num_keys
    block = tl.load(table_ptr + j // KV_BLOCK, mask=in_keys, other=0)
    key_slot = tl.where(j < seq_len, block * KV_BLOCK + j % KV_BLOCK, scratch_slot)
    tl.store(key_slots_ptr + out_row * num_keys + j, key_slot, mask=in_keys)
    if chunk == 0:
        i = tl.arange(0, BLOCK_Q)
        in_q = i < q
        pos = start + i
        pos_block = tl.load(table_ptr + pos // KV_BLOCK, mask=in_q, other=0)
        tl.store(slots_ptr + out_row * q + i, pos_block * KV_BLOCK + pos % KV_BLOCK, mask=in_q)
        if table == 0:  # the same for every table
            tl.store(q_pos_ptr + r * q + i, pos, mask=in_q)
            tl.store(seq_lens_ptr + r, seq_len)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key)."""
    del interpret
    return jit_functions(__name__, (_decode_metadata_kernel,))["_decode_metadata_kernel"]


def _check(state: torch.Tensor, q: int, num_keys: int, block_size: int, table_col: int,
           num_tables: int = 1, table_stride: int = 0) -> None:
    if state.dim() != 2 or state.dtype != torch.int64 or state.stride(1) != 1:
        raise ValueError(f"state must be a 2-D int64 tensor with unit column stride, got "
                         f"{state.dtype} {tuple(state.shape)} strides {tuple(state.stride())}")
    if q < 1 or block_size < 1 or num_keys % block_size:
        raise ValueError(f"need q >= 1 and num_keys a multiple of block_size, got q={q}, "
                         f"num_keys={num_keys}, block_size={block_size}")
    num_blocks = num_keys // block_size
    if num_tables < 1 or (num_tables > 1 and table_stride < num_blocks):
        raise ValueError(f"need num_tables >= 1 and, for several tables, table_stride >= the "
                         f"{num_blocks} blocks of a table (tables must not overlap), got "
                         f"num_tables={num_tables}, table_stride={table_stride}")
    last_col = table_col + (num_tables - 1) * table_stride + num_blocks
    if last_col > state.shape[1]:
        raise ValueError(f"the block table (columns {table_col}.. of {num_blocks} blocks"
                         + (f", {num_tables} tables {table_stride} columns apart" if num_tables > 1 else "")
                         + f") does not fit the state's {state.shape[1]} columns")


def decode_metadata_tables(state: torch.Tensor, q: int, num_keys: int, block_size: int,
                           scratch_slot: int, num_tables: int = 1, table_col: int = 2, table_stride: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [R, q], slots [T, R, q], key_slots [T, R, num_keys], seq_lens [R])``, int64,
    contiguous, for ``T = num_tables`` block tables in one launch.

    Args:
        state: ``[R, W]`` int64 request rows ``[start_pos, seq_len, block tables...]``, table
            ``t`` from column ``table_col + t * table_stride`` (unit column stride; any row stride).
        q: new tokens a request; num_keys: the key axis (a multiple of ``block_size``).
        scratch_slot: the cache slot of keys at or past ``seq_len``.
    """
    _check(state, q, num_keys, block_size, table_col, num_tables, table_stride)
    r = state.shape[0]
    dev = state.device
    q_pos = torch.empty((r, q), dtype=torch.int64, device=dev)
    slots = torch.empty((num_tables, r, q), dtype=torch.int64, device=dev)
    key_slots = torch.empty((num_tables, r, num_keys), dtype=torch.int64, device=dev)
    seq_lens = torch.empty((r,), dtype=torch.int64, device=dev)
    if r == 0:
        return q_pos, slots, key_slots, seq_lens
    block_q = 1 << max(0, q - 1).bit_length()
    _kernel(interpret_mode())[(r, -(-num_keys // BLOCK_L), num_tables)](
        state, q_pos, slots, key_slots, seq_lens, state.stride(0), q, num_keys, scratch_slot,
        KV_BLOCK=block_size, TABLE_COL=table_col, TABLE_STRIDE=table_stride if num_tables > 1 else 0,
        BLOCK_Q=block_q, BLOCK_L=BLOCK_L, num_warps=4)
    return q_pos, slots, key_slots, seq_lens


def decode_metadata(state: torch.Tensor, q: int, num_keys: int, block_size: int,
                    scratch_slot: int, table_col: int = 2
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [R, q], slots [R, q], key_slots [R, num_keys], seq_lens [R])`` of the one block
    table at ``table_col`` (:func:`decode_metadata_tables` with one table)."""
    q_pos, slots, key_slots, seq_lens = decode_metadata_tables(state, q, num_keys, block_size, scratch_slot,
                                                               table_col=table_col)
    return q_pos, slots[0], key_slots[0], seq_lens


def decode_metadata_reference(state: torch.Tensor, q: int, num_keys: int, block_size: int,
                              scratch_slot: int, table_col: int = 2
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode_metadata` in torch ops (the CPU path, and the oracle of the kernel)."""
    _check(state, q, num_keys, block_size, table_col)
    bs = block_size
    tables = state[:, table_col : table_col + num_keys // bs]
    q_pos = state[:, :1] + torch.arange(q, device=state.device)  # [R, q]
    slots = tables.gather(1, q_pos // bs) * bs + q_pos % bs
    j = torch.arange(num_keys, device=state.device)
    seq_lens = state[:, 1].contiguous()  # a column of the state: strided
    key_slots = torch.where(j < seq_lens[:, None], tables[:, j // bs] * bs + j % bs, scratch_slot)
    return q_pos, slots, key_slots, seq_lens


def decode_metadata_tables_reference(state: torch.Tensor, q: int, num_keys: int, block_size: int,
                                     scratch_slot: int, num_tables: int = 1, table_col: int = 2,
                                     table_stride: int = 0
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode_metadata_tables` in torch ops: each table's :func:`decode_metadata_reference`."""
    _check(state, q, num_keys, block_size, table_col, num_tables, table_stride)
    per_table = [decode_metadata_reference(state, q, num_keys, block_size, scratch_slot, table_col + t * table_stride)
                 for t in range(num_tables)]
    q_pos, _, _, seq_lens = per_table[0]
    return (q_pos, torch.stack([m[1] for m in per_table]), torch.stack([m[2] for m in per_table]), seq_lens)
