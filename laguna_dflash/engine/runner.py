"""Flat varlen batches: build the per-forward metadata and run a model over the paged cache.

All index math happens here once per forward on host tensors (pinned on CUDA) and is shipped
with one non-blocking copy; the model forward itself never reads device values back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.layers import ForwardContext
from .attention import AttentionBackend, AttentionMetadata
from .cuda_graph import CUDAGraphRunner, DeviceStart, StagedDecode
from .kv_cache import KVCache


@dataclass(frozen=True)
class ForwardItem:
    """One request's slice of a flat forward.

    ``num_tokens`` query tokens at positions ``start_pos ..``; after their K/V are written the
    request sees keys at positions ``< seq_len``.
    """

    num_tokens: int
    start_pos: int
    seq_len: int
    block_table: list[int]
    # the hybrid layout's sliding-window groups' tables (kv_cache.HybridLayout); () otherwise;
    # their entries before swa_start are the scratch block (outside every window)
    swa_block_tables: tuple[list[int], ...] = ()
    swa_start: int = 0
    # block_table is a sliding group's too (the drafter's in the hybrid layout): its entries
    # before swa_start are the scratch block as well
    is_window_table: bool = False


def forward_item(seq, num_tokens: int, start_pos: int, seq_len: int) -> ForwardItem:
    """``seq``'s slice of a target forward: its block tables (every group's)."""
    return ForwardItem(num_tokens, start_pos, seq_len, seq.block_table, tuple(seq.swa_block_tables),
                       seq.swa_start)


# False: plain blocking uploads in to_device_async (an A/B switch for benchmarks)
async_uploads = True

# Writes the drafter's context K/V of a forward's taps: (taps [T, n_taps * H] in the model
# dtype, positions [T] int64, cache slots [T] int64), all on the device.
ContextStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host: to CUDA through pinned memory
    (``non_blocking``; the caching host allocator keeps the buffer until the copy ran). A plain
    ``.to("cuda")`` of pageable memory synchronises the stream first, so the host would wait
    for every kernel queued so far before it could prepare the next launch."""
    if device.type == "cuda" and async_uploads:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# True: HostCopy's device-to-host copy runs on a side stream (behind an event on the current
# stream), so the next step's work queued behind it does not wait for the copy engine; False:
# on the current stream (the A/B baseline)
host_copy_on_side_stream = True


@functools.cache
def _host_copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class HostCopy:
    """A device tensor's copy to the host, queued now; :meth:`tolist` waits only for that copy,
    so work queued after it (the next step's forward or drafter block) keeps the GPU busy while
    the host reads the result. On CPU it is the tensor itself.

    With :data:`host_copy_on_side_stream` the copy runs on a side stream that first waits for
    the current stream's work so far: the current stream's next launch need not wait for the
    copy (~5-6 us a step of copy-engine latency on the critical path, docs/PERFORMANCE.md,
    eighty-first pass). ``t``'s memory is not reused before the copy ran (``record_stream``),
    and ``t`` must not be written by later work before :meth:`tolist` (or :attr:`done`) says the
    copy ran: the step's own tokens, fresh each step, are never written again."""

    def __init__(self, t: torch.Tensor) -> None:
        self.done = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.done = torch.cuda.Event()
            if host_copy_on_side_stream:
                side = _host_copy_stream(t.device)
                side.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(side):
                    self.host.copy_(t, non_blocking=True)
                    self.done.record(side)
                t.record_stream(side)
            else:
                self.host.copy_(t, non_blocking=True)
                self.done.record()
        else:
            self.host = t

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def _slots(items: list[ForwardItem], tables_of, block_size: int, scratch_slot: int, lmax: int,
           req_of_token: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_mapping ``[T]``, key_slots ``[R, width]``) int64 of the block tables
    ``tables_of(item)`` (host tensors; width: Lmax rounded up to a multiple of 16)."""
    width = -(-lmax // 16) * 16
    max_blocks = max(max(len(tables_of(it)) for it in items), -(-width // block_size))
    tables = torch.full((len(items), max_blocks), scratch_slot // block_size, dtype=torch.long)
    for i, it in enumerate(items):
        tables[i, : len(tables_of(it))] = torch.tensor(tables_of(it), dtype=torch.long)
    slot_mapping = tables[req_of_token, positions // block_size] * block_size + positions % block_size
    # key_slots' row stride is Lmax rounded up to a multiple of 16 (a [R, Lmax] view of wider
    # rows): Triton specialises integer arguments, strides among them, on divisibility by 16, so
    # an exact Lmax stride gave each kernel reading key_slots a variant per Lmax % 16 == 0 or not,
    # built on first use (the graphs' key buckets are multiples of 16 already)
    j = torch.arange(width)
    key_slots = tables[:, j // block_size] * block_size + (j % block_size).view(1, -1)
    key_slots = torch.where(j.view(1, -1) < seq_lens.view(-1, 1), key_slots, torch.full((), scratch_slot))
    return slot_mapping, key_slots


def build_metadata(
    items: list[ForwardItem],
    block_size: int,
    scratch_slot: int,
    device: torch.device,
    is_causal: bool = True,
) -> AttentionMetadata:
    """Index tensors for a flat batch of ``T = sum(num_tokens)`` tokens from ``R`` requests
    (of the items' ``block_table``)."""
    return build_group_metadata(items, block_size, scratch_slot, device, is_causal)[0]


def build_group_metadata(
    items: list[ForwardItem],
    block_size: int,
    scratch_slot: int,
    device: torch.device,
    is_causal: bool = True,
) -> tuple[AttentionMetadata, tuple[AttentionMetadata, ...]]:
    """:func:`build_metadata`, and one metadata of each of the items' ``swa_block_tables``
    (the same but for ``slot_mapping`` and ``key_slots``)."""
    r = len(items)
    qmax = max(it.num_tokens for it in items)
    lmax = max(it.seq_len for it in items)
    starts = torch.tensor([it.start_pos for it in items], dtype=torch.long)
    counts = torch.tensor([it.num_tokens for it in items], dtype=torch.long)
    seq_lens = torch.tensor([it.seq_len for it in items], dtype=torch.long)
    col = torch.arange(qmax)
    q_valid = col.view(1, -1) < counts.view(-1, 1)  # [R, Qmax]
    q_pos = torch.where(q_valid, starts.view(-1, 1) + col.view(1, -1), torch.full((), -1))
    offsets = torch.cumsum(counts, 0) - counts
    query_index = torch.where(q_valid, offsets.view(-1, 1) + col.view(1, -1), torch.zeros((), dtype=torch.long))
    flat_index = (torch.arange(r).view(-1, 1) * qmax + col.view(1, -1))[q_valid]
    positions = q_pos[q_valid]
    req_of_token = torch.arange(r).repeat_interleave(counts)
    slots = functools.partial(_slots, items, block_size=block_size, scratch_slot=scratch_slot, lmax=lmax,
                              req_of_token=req_of_token, positions=positions, seq_lens=seq_lens)
    slot_mapping, key_slots = slots(lambda it: it.block_table)
    dev = functools.partial(to_device_async, device=device)
    meta = AttentionMetadata(
        positions=dev(positions), slot_mapping=dev(slot_mapping), flat_index=dev(flat_index),
        query_index=dev(query_index), query_positions=dev(q_pos), key_slots=dev(key_slots)[:, :lmax],
        seq_lens=dev(seq_lens), is_causal=is_causal,
    )
    swa_metas = []
    for g in range(len(items[0].swa_block_tables)):
        swa_slot_mapping, swa_key_slots = slots(lambda it, g=g: it.swa_block_tables[g])
        swa_metas.append(dataclasses.replace(meta, slot_mapping=dev(swa_slot_mapping),
                                             key_slots=dev(swa_key_slots)[:, :lmax], _masks={}))
    return meta, tuple(swa_metas)


class ModelRunner:
    """Owns a model, its KV cache and the attention backend; runs flat forwards."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.graphs: CUDAGraphRunner | None = None  # set by the engine on CUDA unless enforce_eager
        # set by the engine with a drafter: what ``forward(store_context=True)`` hands its taps to
        self.context_store: ContextStore | None = None

    def stage_decode(self, items: list[ForwardItem], tap_layer_ids: tuple[int, ...] = ()) -> StagedDecode | None:
        """Upload the rows of a target decode forward (one token a request, causal, no context
        store) whose token ids are still being computed (``CUDAGraphRunner.stage_decode``); None
        where a graph would not run it (use :meth:`forward`). Then :meth:`run_staged`."""
        if self.graphs is None or not items or any(it.num_tokens != 1 for it in items):
            return None
        if not self.graphs.can_run(items, len(items)):
            return None
        return self.graphs.stage_decode(items, tuple(tap_layer_ids))

    def run_staged(self, staged: StagedDecode, ids: torch.Tensor,
                   copy_hidden: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` of the staged rows with token ids ``ids [R]`` int64 on the device."""
        return self.graphs.run_staged(staged, ids, copy_hidden)

    def context(self, items: list[ForwardItem], is_causal: bool = True) -> ForwardContext:
        meta, swa_metas = build_group_metadata(items, self.kv_cache.block_size, self.kv_cache.scratch_slot,
                                               self.device, is_causal)
        return ForwardContext(meta=meta, kv_caches=self.kv_cache.layers, backend=self.backend,
                              swa_metas=swa_metas, group_of_layer=self.kv_cache.group_of_layer)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: list[int] | torch.Tensor,
        items: list[ForwardItem],
        tap_layer_ids: tuple[int, ...] = (),
        is_causal: bool = True,
        store_context: bool = False,
        tail_ids: torch.Tensor | None = None,
        device_start: DeviceStart | None = None,
        copy_hidden: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the target over a flat batch -> (final-normed hidden ``[T, H]``, taps or None).

        Decode-phase batches (every request ``q`` new tokens) replay a CUDA graph when enabled, and
        so do short prefills (``CUDAGraphRunner.prefill_shape``, padded).
        ``store_context``: the taps go to ``context_store`` at the tokens' positions and cache
        slots inside the forward (inside its CUDA graph), and are not returned (``None``).
        ``tail_ids [R, c]`` int64 on the device: each request's last ``c`` token ids, written
        over those ``input_ids`` (a list then: placeholders there); every item the same
        ``num_tokens``. ``device_start``: first positions and first token ids known only on the
        device (``cuda_graph.DeviceStart``); graphs only (``graphs.can_run`` must hold).
        ``copy_hidden=False``: a replay's hidden states are returned as a view of the graph's
        static output, for a caller that queues its consumer before the runner replays any
        graph again (the runner's graphs share one memory pool: a later replay of another may
        write there); the copy would be a launch.
        """
        store = self.context_store if store_context else None
        assert store is not None or not store_context, "store_context needs a context_store"
        if self.graphs is not None:
            if self.graphs.can_run(items, len(input_ids)):
                return self.graphs.forward(input_ids, items, tap_layer_ids, is_causal, store, tail_ids=tail_ids,
                                           device_start=device_start, copy_hidden=copy_hidden)
            is_prefill = not isinstance(input_ids, torch.Tensor) and store is None and is_causal
            shape = self.graphs.prefill_shape(items, len(input_ids)) if is_prefill else None
            if shape is not None:
                return self.graphs.forward(input_ids, items, tap_layer_ids, is_causal, shape=shape)
        assert device_start is None, "device start positions need the graph runner"
        ids = (input_ids.to(self.device) if isinstance(input_ids, torch.Tensor)  # on the device already
               else to_device_async(torch.tensor(input_ids, dtype=torch.long), self.device))
        if tail_ids is not None:  # ids: a fresh upload of the list (placeholders at the tail)
            assert not isinstance(input_ids, torch.Tensor), "tail_ids go with a list of input_ids"
            ids = ids.view(len(items), -1)
            ids[:, ids.shape[1] - tail_ids.shape[1] :] = tail_ids
            ids = ids.view(-1)
        ctx = self.context(items, is_causal)
        hidden, taps = self.model(ids, ctx, tap_layer_ids)
        if store is not None:  # at the slots of the drafter's table (kv_cache.draft_group)
            store(taps, ctx.meta.positions, ctx.meta_of_group(self.kv_cache.draft_group).slot_mapping)
            taps = None
        return hidden, taps
