"""CUDA graphs for the fixed-shape forwards of a decode step: target decode / verify, drafter block.

A decode-phase forward runs ``R`` requests with the same number ``q`` of new tokens each
(target decode ``q = 1``, verify and drafter block ``q = K + 1``). It is replayed from a graph
captured for the key ``(R_pad, q, L_pad, is_causal, taps, stores context)``:

* ``R_pad``: the smallest capture batch size ``>= R``. Padding requests write their K/V into the
  scratch block (every row of their block table is the scratch block) and attend to their own
  ``q`` keys there, so they stay finite; their outputs are dropped.
* ``L_pad``: the key length, a power of two ``>= max(seq_len)`` (at least 256, a multiple of the
  KV block size), so the key axis of the attention metadata is static while wasting at most 2x.

Everything the forward reads lives in one persistent device buffer, a row per request (first
position, visible length, block table, token ids), filled in a reused pinned host buffer and
shipped with ONE copy; but a forward of one token a request (target decode) reads its token ids
from ``decode_ids``, where the previous step's argmax writes them while these rows' upload
runs on a side stream (``stage_decode``, ``run_staged``). The attention metadata (positions,
slot mapping, key slots, query index) is recomputed from it *inside* the graph, so a replay
needs no device-to-host read. Its columns are strided views: kernels must honour their strides
(or get contiguous copies). Graphs are captured
at start-up (``capture_all``, after one parallel build of their Triton kernels) or the first time
a key is seen (its kernels built in parallel first), after :data:`num_capture_warmups` eager
warm-up runs on a side stream; all graphs share one memory pool. Outputs are copied out of the graph's static
tensors before the next replay can overwrite them.

A prefill forward (requests of any token counts, each ending its sequence) of at most
:data:`MAX_PREFILL_GRAPH_REQUESTS` requests replays the graph of ``(R_pad, q_pad)`` too, where
``q_pad`` is the smallest of :data:`PREFILL_GRAPH_TOKENS` ``>=`` its longest request and
``R_pad * q_pad <= max_prefill_tokens`` (``EngineConfig.max_prefill_graph_tokens``); longer
prefills stay eager. A request's ``q_pad - n`` padding tokens sit at positions ``start + n ..``
past its sequence: they write K/V only there (its own not-yet-computed slots, rewritten when
those positions are computed, or the scratch block past its block table; never a shared prefix
block, which ends before ``start``) and no real query sees them (keys ``< seq_len`` only); their
outputs are dropped. Eager, such a step is host-bound on the H200 (a 16-token prefill at XS-2.1
size: 31 ms wall for 8 ms of kernels, docs/PERFORMANCE.md).
The verify forward of a DFlash step captures the drafter's context K/V store of its taps after
the target's layers (``ModelRunner.forward(store_context=True)``); the context K/V of the taps
left pending by target-only steps replays from its own graphs (engine/context_graph.py) unless
``EngineConfig.graph_context_precompute`` is False.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from ..kernels import decode_metadata, precompile
from ..kernels.availability import triton_importable
from ..kernels.rewind_rows import rewind_rows
from ..models.layers import ForwardContext, building_cuda_graph
from .attention import AttentionBackend, AttentionMetadata
from .host_rows import RowTables
from .kv_cache import KVCache

if TYPE_CHECKING:
    from .runner import ContextStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIN_KEY_BUCKET = 256
# The token counts a prefill forward is padded to (per request) when it replays a graph.
PREFILL_GRAPH_TOKENS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# The most requests a graphed prefill step holds (prefill steps of more requests stay eager): a
# step usually prefills what arrived since the last one, and every request count doubles the
# graphs captured per token bucket.
MAX_PREFILL_GRAPH_REQUESTS = 4
# The attention metadata in one Triton launch (kernels/decode_metadata.py) instead of ~17 torch
# kernels at the head of every replay; an A/B switch (graphs captured after a change must be
# re-captured: ``CUDAGraphRunner.reset``).
use_metadata_kernel = True
# Start-up capture first builds the Triton kernels of every graph it will capture, in parallel
# (build_kernels_ahead), and so does each capture a step makes on first use (lazy capture, the
# warm-up's batch-1 graphs) for its one forward; False: each kernel is built when a capture
# first launches it (an A/B switch).
build_ahead = True
# Eager runs of a forward, on a side stream, before its capture: the first builds any kernel not
# built ahead, lets torch.compile specialise and cuBLAS choose (vLLM captures after one warm-up
# run too). 2 was the default until the thirty-eighth pass (docs/PERFORMANCE.md): with the
# switch below, 1 cut start-up at the server's defaults from 120.9 s to 89.0 s, same graphs,
# same step times.
num_capture_warmups = 1
# torch.cuda.graph empties the allocator's cache (and the pinned host cache) before every capture,
# so every capture's warm-ups allocate their activations anew. True: inside ``captures_in_a_row``
# (the start-up capture) only the first capture empties it, and the scope's end empties it once.
# False: every capture empties it (the default until the thirty-eighth pass; an A/B switch).
keep_cache_between_captures = True
# stage_decode uploads the next decode's rows on a side stream, while the current stream runs
# the lm_head whose argmax gives that decode's ids; False: on the current stream (A/B baseline)
stage_uploads_on_side_stream = True


@dataclass
class _CaptureRow:
    is_active: bool = False
    is_emptied: bool = False  # a capture of the row has emptied the caches already


_capture_row = _CaptureRow()


@contextlib.contextmanager
def captures_in_a_row(device: torch.device):
    """Scope of many captures one after another (start-up capture): the allocator's cache is
    emptied before the first and after the last only (:data:`keep_cache_between_captures`)."""
    if device.type != "cuda" or not keep_cache_between_captures or _capture_row.is_active:
        yield
        return
    _capture_row.is_active, _capture_row.is_emptied = True, False
    try:
        yield
    finally:
        _capture_row.is_active = False
        torch.cuda.empty_cache()  # the warm-ups' cached blocks and any dropped graph's pool


def capture_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``
    (so padding wastes at most 7 requests above 8, at most half below)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return tuple(sorted(set(sizes + [max_num_seqs])))


def capture_graph(fn: Callable[[], T], device: torch.device, pool,
                  build_first: bool = False) -> tuple[torch.cuda.CUDAGraph, T, object]:
    """Capture ``fn`` in a CUDA graph in memory pool ``pool`` (``None``: a new one) after
    :data:`num_capture_warmups` eager warm-up runs on a side stream (Triton and torch.compile build there, cuBLAS picks its
    kernels). Returns (graph, ``fn``'s static outputs, the pool to share with later captures).
    The warm-ups compute what the replay will, so their writes (K/V) must be idempotent.
    ``build_first`` (a capture on first use, not after start-up's pass): with
    :data:`build_ahead`, first build the Triton kernels ``fn`` launches in parallel
    (:func:`build_kernels_ahead`), not one after another inside the warm-up runs."""
    if build_first and build_ahead:
        build_kernels_ahead([fn], device)
    side = _warmup_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with building_cuda_graph():  # graph-only kernel choices (models.layers.linear)
        with torch.cuda.stream(side):
            for _ in range(max(1, num_capture_warmups)):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if _capture_row.is_active and _capture_row.is_emptied:
            torch.cuda.synchronize(device)  # as torch.cuda.graph, less its emptying of the caches
            out = _capture_into(graph, fn, _capture_stream(device), pool)
        else:
            with torch.cuda.graph(graph, pool=pool):
                out = fn()
            _capture_row.is_emptied = _capture_row.is_active
    return graph, out, graph.pool()


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.cache
def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture's eager warm-ups run on. The caching allocator keeps a
    freed block for reuse on the stream that allocated it only, so with a new stream per
    capture and the cache kept between captures (:data:`keep_cache_between_captures`) each
    capture's warm-up activations took new segments, held until the start-up capture's end:
    torch's peak reserved reached 137.7 GiB of 139.8 at XS-2.1 size, 10.4 above what start-up
    left reserved (docs/PERFORMANCE.md, thirty-ninth pass). On this one stream the same start-up
    peaked at 127.0, 0.6 above (fortieth pass)."""
    return torch.cuda.Stream(device)


def _capture_into(graph: torch.cuda.CUDAGraph, fn: Callable[[], T], stream: torch.cuda.Stream,
                  pool) -> T:
    """Capture ``fn`` into ``graph`` on ``stream`` in memory pool ``pool`` (``None``: a new one)."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            return fn()
        finally:
            graph.capture_end()


def _record_only(fn: Callable[[], object], stream: torch.cuda.Stream, pool) -> torch.cuda.CUDAGraph:
    """Record ``fn`` into a CUDA graph that is never instantiated nor replayed: nothing runs.
    The caller keeps the graph until it has recorded every graph sharing ``pool`` (the
    allocator refuses a pool whose graphs are all gone but whose blocks are not yet freed)."""
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # no instantiation at capture_end
    except TypeError:  # a torch without keep_graph: instantiated, then dropped
        graph = torch.cuda.CUDAGraph()
    _capture_into(graph, fn, stream, pool)
    return graph


@functools.cache
def _blas_ready(device: torch.device) -> bool:
    """Run one eager cuBLAS GEMM, with and without a bias (the cuBLASLt path), on ``device``,
    once a process. Both libraries make their handles on first use, and a first use inside a
    recording allocates, which invalidates the capture. The first forward of a fresh process is
    recorded (:func:`build_kernels_ahead`) before any eager run. This is the suspected cause of
    the float32 warm-up's "building kernels ahead stopped after 0 of 1 forwards ... a previous
    error during capture" (twenty-eighth and thirty-third passes, docs/PERFORMANCE.md): bf16
    engines, which never logged it, run no cuBLAS GEMM in their first forward. With it, a fresh
    float32 engine on the H200 builds its first forward ahead with no such warning
    (``test_fresh_float32_engine_builds_its_first_forward_ahead``, thirty-fourth pass); the
    test has not been run with this GEMM removed, so the cause is likely, not proven."""
    a = torch.ones(16, 16, device=device)
    torch.nn.functional.linear(a, a, a[0])
    torch.mm(a, a)
    return True


def build_kernels_ahead(forwards: list[Callable[[], object]], device: torch.device) -> int:
    """Build the Triton kernel variants that ``forwards`` launch, on a thread pool, before they
    are captured (:mod:`kernels.precompile`). Each forward is recorded into a throwaway CUDA
    graph while Triton launches only submit builds, so nothing executes: no kernel reads
    another's unwritten output, and no cache or buffer is written. Call it in the scope the
    captures will run in (``inference_mode``, ``batch_invariant.scope``). A forward that cannot
    be recorded ends the pass with a warning; the captures then build the rest one at a time.
    -> the variants built (or failed)."""
    if not forwards or device.type != "cuda" or not triton_importable():
        return 0
    _blas_ready(device)
    t0 = time.perf_counter()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    pool = torch.cuda.graph_pool_handle()
    recorded: list[torch.cuda.CUDAGraph] = []
    with precompile.launches_build_only() as builds, building_cuda_graph():
        try:
            for fn in forwards:
                recorded.append(_record_only(fn, stream, pool))
        except Exception as e:  # noqa: BLE001 - only a speed-up: the captures still build
            logger.warning("building kernels ahead stopped after %d of %d forwards (the captures "
                           "build the rest one at a time): %s", len(recorded), len(forwards), e)
    recorded.clear()  # the throwaway graphs (the next capture's empty_cache frees their pool)
    # a first-use capture whose kernels are all built already logs nothing at INFO
    logger.log(logging.INFO if builds.num_submitted else logging.DEBUG,
               "built %d Triton kernel variants for %d forwards ahead of their capture in %.1fs "
               "(%d threads)", builds.num_submitted, len(forwards), time.perf_counter() - t0,
               builds.num_threads)
    return builds.num_submitted


@dataclass(frozen=True)
class DeviceStart:
    """First positions and first token ids of a decode-phase forward known only on the device
    (a drafter block queued ahead, engine/ahead.py): request ``i`` starts ``S - accepted[i]``
    positions before its item's ``start_pos`` (its ``seq_len`` moves with it), and its first
    token id is ``tokens[i, accepted[i]]``; the items' positions are upper bounds."""

    accepted: torch.Tensor  # [R] int32 / int64 on the device, each 0..S
    tokens: torch.Tensor  # [R, S + 1] int64 on the device


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [R_pad * q, H] static output
    taps: torch.Tensor | None  # [R_pad * q, n_taps * H] static output


@dataclass(frozen=True)
class StagedDecode:
    """A one-token-a-request forward whose rows are uploaded (``CUDAGraphRunner.stage_decode``)
    and whose token ids are not known yet."""

    items: list
    r_pad: int
    num_keys: int
    tap_layer_ids: tuple[int, ...]
    ids: torch.Tensor  # [R] int64 view of the runner's decode_ids: where the ids go


class CUDAGraphRunner:
    """Replays decode-phase forwards of ``model`` from CUDA graphs (see the module docstring).

    ``max_tokens_per_request`` bounds ``q`` (K + 1); ``max_model_len`` bounds ``seq_len``;
    ``max_prefill_tokens`` bounds ``R_pad * q_pad`` of a graphed prefill (0: prefills eager).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device, max_num_seqs: int, max_model_len: int,
                 max_tokens_per_request: int, max_prefill_tokens: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.max_tokens_per_request = max_tokens_per_request
        self.max_prefill_tokens = max_prefill_tokens
        bs = kv_cache.block_size
        self.block_size = bs
        self.scratch_block = kv_cache.scratch_slot // bs
        self.max_keys = self.key_bucket(max_model_len + max_tokens_per_request)
        # a bucket past the key capacity could never be taken (prefill_shape): not even a row width
        self.prefill_buckets = tuple(q for q in PREFILL_GRAPH_TOKENS
                                     if q <= min(max_prefill_tokens, self.max_keys))
        self.prefill_batch_sizes = tuple(r for r in self.batch_sizes if r <= MAX_PREFILL_GRAPH_REQUESTS)
        max_r, max_q = self.batch_sizes[-1], max((max_tokens_per_request, *self.prefill_buckets))
        # Bound (exclusive) on every position a forward here computes, padding included: the
        # RoPE tables must cover it (the engine grows them to it). can_run and prefill_shape
        # refuse a forward past it (it runs eagerly) and a capture computes positions < q, so
        # it holds whatever the callers do. Sized so that none is refused: a prefill's real
        # tokens end its sequence (< max_model_len), so its padding ends below max_model_len +
        # q_pad; a verify ends at P + K + 1 and a drafter block queued ahead at P + 2K + 2
        # (engine/spec_decode.py), P < max_model_len. The engine's own tables, max_model_len +
        # K + 1 positions, are too short for the first and the last.
        self.max_positions = min(self.max_keys,
                                 max_model_len + max(max_q, 2 * max_tokens_per_request))
        # Request state, one row per request: [start_pos, seq_len, block table (max_blocks),
        # each SWA group's block table (max_blocks each; hybrid KV layout), token ids (max_q)].
        # Filled on the host in a reused (pinned on CUDA) buffer and shipped with ONE copy per
        # forward; the views below are what the captured forwards read.
        self.max_blocks = self.max_keys // bs
        layout = kv_cache.layout
        self.num_tables = 1 + (layout.num_swa_groups if layout is not None else 0)
        self.ids_offset = 2 + self.num_tables * self.max_blocks
        width = self.ids_offset + max_q
        pin = device.type == "cuda"
        self.host_state = torch.zeros(max_r, width, dtype=torch.long, pin_memory=pin)
        self.host_rows = self.host_state.numpy()
        self.tables = RowTables(self.host_rows, self.num_tables, self.max_blocks, self.scratch_block)
        self.copied = torch.cuda.Event() if pin else None  # the last copy out of host_state
        self.state = torch.zeros(max_r, width, dtype=torch.long, device=device)
        # The token ids of a forward of one token a request (target decode): its graphs read
        # them here, not from state, so that the lm_head's argmax can write them in place while
        # the next rows' upload (stage_decode) runs on a side stream
        self.decode_ids = torch.zeros(max_r, dtype=torch.long, device=device)
        self._upload_stream: torch.cuda.Stream | None = None
        self._staged_upload: torch.cuda.Event | None = None  # a side-stream upload not waited for
        self.start_pos = self.state[:, 0]
        self.seq_lens = self.state[:, 1]
        self.block_tables = self.state[:, 2 : 2 + self.max_blocks]  # the full layers' tables
        self.flat_index = torch.arange(max_r * max_q, device=device)
        self.graphs: dict[tuple, _Captured] = {}
        # every forward kind captured so far, (q, is_causal, taps, has a context store) -> the
        # store: what capture_all extends to every batch size and key bucket
        self.kinds: dict[tuple, ContextStore | None] = {}
        self.prefill_only_kinds: set[tuple] = set()  # kinds only prefills ran (kind_batch_sizes)
        self.pool = None

    def reset(self) -> None:
        """Drop every captured graph and their memory pool (the next forward recaptures, e.g.
        after a fast-path switch changed what a forward launches)."""
        self.graphs.clear()
        self.kinds.clear()
        self.prefill_only_kinds.clear()
        self.pool = None

    def key_buckets(self, max_seq_len: int) -> list[int]:
        """Every key bucket a forward of at most ``max_seq_len`` keys can take, ascending."""
        out = [self.key_bucket(1)]
        while out[-1] < min(max_seq_len, self.max_keys):
            out.append(self.key_bucket(out[-1] + 1))
        return out

    def kind_batch_sizes(self, kind: tuple) -> tuple[int, ...]:
        """The padded batch sizes captured for a forward kind ``(q, is_causal, taps, stores
        context)``: every one for a decode-phase kind, those :meth:`prefill_shape` can pick
        for a kind only prefills ran (a prefill bucket that is also K + 1 stays a decode kind
        for a drafter's verify, but not for prefills alone: K = 15, bucket 16)."""
        if kind not in self.prefill_only_kinds:
            return self.batch_sizes
        return tuple(r for r in self.prefill_batch_sizes if r * kind[0] <= self.max_prefill_tokens)

    def missing_keys(self, max_model_len: int) -> list[tuple[tuple, ContextStore | None]]:
        """The graph keys :meth:`capture_all` would capture, each with its kind's context store:
        every padded batch size (:meth:`kind_batch_sizes`) x key bucket (up to ``max_model_len
        + q - 1`` keys: a verify's drafts may run past the last position, a padded prefill's
        padding too) of each forward kind captured so far, less those captured already."""
        return [((r, q, num_keys, is_causal, taps, store is not None), store)
                for (q, is_causal, taps, _), store in self.kinds.items()
                for r in self.kind_batch_sizes((q, is_causal, taps, store is not None))
                for num_keys in self.key_buckets(max_model_len + q - 1)
                if num_keys >= q and (r, q, num_keys, is_causal, taps, store is not None) not in self.graphs]

    def add_prefill_kinds(self, tap_layer_ids: tuple[int, ...]) -> None:
        """Register the prefill forward of every token bucket (with ``tap_layer_ids``' taps) for
        :meth:`capture_all`, so that no prefill step stalls for a capture either."""
        for q in self.prefill_buckets:
            self._add_kind((q, True, tuple(tap_layer_ids), False), None, is_prefill=True)

    def _add_kind(self, kind: tuple, store: ContextStore | None, is_prefill: bool) -> None:
        """Remember a forward kind for :meth:`capture_all`; one a decode-phase forward ran is
        captured at every batch size from then on."""
        if kind not in self.kinds:
            self.kinds[kind] = store
            if is_prefill:
                self.prefill_only_kinds.add(kind)
        if not is_prefill:
            self.prefill_only_kinds.discard(kind)

    def forwards_to_capture(self, max_model_len: int) -> list[Callable[[], object]]:
        """The forwards :meth:`capture_all` would capture (for :func:`build_kernels_ahead`)."""
        return [functools.partial(self._run_model, r, q, num_keys, is_causal, taps, store)
                for (r, q, num_keys, is_causal, taps, _), store in self.missing_keys(max_model_len)]

    @torch.inference_mode()  # as the forwards it captures (the fast paths need it)
    def capture_all(self, max_model_len: int, progress=None) -> int:
        """Capture :meth:`missing_keys`, so that no later forward waits for a capture: a new
        batch size or a sequence crossing a key bucket would otherwise stall its step for the
        capture (vLLM captures at start-up the same way). The captures run padding requests only
        (the scratch block). ``progress``: a tqdm bar, advanced per graph. -> graphs captured."""
        if self.device.type != "cuda":
            return 0
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.host_rows  # every row a padding request: q tokens at 0.. of the scratch block
        todo = self.missing_keys(max_model_len)
        padded_q = None
        for (r, q, num_keys, is_causal, taps, _), store in sorted(todo, key=lambda item: item[0][1]):
            if q != padded_q:  # the kinds' q in turn
                padded_q = q
                rows[:, : self.ids_offset + q] = 0
                rows[:, 1] = q
                rows[:, 2 : self.ids_offset] = self.scratch_block
                self.tables.forget()  # every table column rewritten here
                self.state.copy_(self.host_state)
            self.graphs[(r, q, num_keys, is_causal, taps, store is not None)] = self._capture(
                r, q, num_keys, is_causal, taps, store, build_first=False)  # built ahead already
            if progress is not None:
                progress.update(1)
        return len(todo)

    def key_bucket(self, num_keys: int) -> int:
        """Smallest power of two ``>= num_keys`` (min ``MIN_KEY_BUCKET``), a multiple of the
        block size."""
        n = max(MIN_KEY_BUCKET, self.block_size)
        while n < num_keys:
            n *= 2
        return -(-n // self.block_size) * self.block_size

    def can_run(self, items: list, num_input_ids: int) -> bool:
        """True when the forward has the decode-phase shape this runner replays."""
        if not items or len(items) > self.batch_sizes[-1]:
            return False
        q = items[0].num_tokens
        return (
            q <= self.max_tokens_per_request
            and num_input_ids == q * len(items)
            and all(it.num_tokens == q and it.start_pos + q == it.seq_len for it in items)
            and max(it.seq_len for it in items) <= self.max_positions
        )

    def prefill_shape(self, items: list, num_input_ids: int) -> tuple[int, int] | None:
        """``(R_pad, q_pad)`` of the graph that replays a prefill forward of ``items`` (any
        token counts, each request's tokens ending its sequence), or None (eager): more than
        :data:`MAX_PREFILL_GRAPH_REQUESTS` requests, ``R_pad * q_pad`` past
        ``max_prefill_tokens``, or padding past :attr:`max_positions`."""
        if not self.prefill_buckets or not items or len(items) > MAX_PREFILL_GRAPH_REQUESTS:
            return None
        longest = max(it.num_tokens for it in items)
        q_pad = next((q for q in self.prefill_buckets if q >= longest), None)
        r_pad = next((r for r in self.prefill_batch_sizes if r >= len(items)), None)
        if q_pad is None or r_pad is None or r_pad * q_pad > self.max_prefill_tokens:
            return None
        if (num_input_ids != sum(it.num_tokens for it in items)
                or any(it.start_pos + it.num_tokens != it.seq_len for it in items)
                or max(it.start_pos for it in items) + q_pad > self.max_positions):
            return None
        return r_pad, q_pad

    def _metadata(self, r: int, q: int, num_keys: int, is_causal: bool) -> list[AttentionMetadata]:
        """Attention metadata of the padded batch, one a block table (the full layers', then
        each SWA group's), computed on the device from the buffers: one kernel for every table
        (kernels/decode_metadata.py) where Triton runs, else the same in torch ops. The tables
        share the positions and sequence lengths (the same tensors)."""
        args = (self.state[:r], q, num_keys, self.block_size, self.kv_cache.scratch_slot, self.num_tables,
                2, self.max_blocks)
        if use_metadata_kernel and decode_metadata.is_available(self.device):
            q_pos, slots, key_slots, seq_lens = decode_metadata.decode_metadata_tables(*args)
        else:
            q_pos, slots, key_slots, seq_lens = decode_metadata.decode_metadata_tables_reference(*args)
        flat = self.flat_index[: r * q]  # a view of a constant: no kernel in the graph
        return [AttentionMetadata(
            positions=q_pos.reshape(-1), slot_mapping=slots[table].reshape(-1), flat_index=flat,
            query_index=flat.view(r, q), query_positions=q_pos, key_slots=key_slots[table],
            seq_lens=seq_lens, is_causal=is_causal,
        ) for table in range(self.num_tables)]

    def _run_model(self, r: int, q: int, num_keys: int, is_causal: bool, tap_layer_ids: tuple[int, ...],
                   context_store: ContextStore | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta, *swa_metas = self._metadata(r, q, num_keys, is_causal)
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_cache.layers, backend=self.backend,
                             swa_metas=tuple(swa_metas), group_of_layer=self.kv_cache.group_of_layer)
        # [r * q]: one token a request from decode_ids (the lm_head's argmax writes them there)
        input_ids = self.decode_ids[:r] if q == 1 else self.state[:r, self.ids_offset : self.ids_offset + q].reshape(-1)
        hidden, taps = self.model(input_ids, ctx, tap_layer_ids)
        if context_store is not None:  # padding requests' rows go to the scratch slots
            # at the slots of the drafter's table (kv_cache.draft_group: a sliding group's)
            context_store(taps, meta.positions, ctx.meta_of_group(self.kv_cache.draft_group).slot_mapping)
            taps = None
        return hidden, taps

    def _capture(self, r: int, q: int, num_keys: int, is_causal: bool, tap_layer_ids: tuple[int, ...],
                 context_store: ContextStore | None, build_first: bool = True) -> _Captured:
        graph, (hidden, taps), self.pool = capture_graph(
            lambda: self._run_model(r, q, num_keys, is_causal, tap_layer_ids, context_store),
            self.device, self.pool, build_first)
        logger.info("captured a CUDA graph: %d requests x %d tokens, %d keys%s", r, q, num_keys,
                    ", with the drafter's context store" if context_store is not None else "")
        return _Captured(graph, hidden, taps)

    def _batch(self, items: list, shape: tuple[int, int] | None) -> tuple[int, int, int, int]:
        """``(R, R_pad, q, num_keys)`` of a forward of ``items`` (``shape``: a padded prefill's)."""
        r = len(items)
        if shape is None:
            q = items[0].num_tokens
            r_pad = next(b for b in self.batch_sizes if b >= r)
        else:
            r_pad, q = shape
        return r, r_pad, q, self.key_bucket(max(it.start_pos for it in items) + q)

    def _write_rows(self, input_ids: list[int] | torch.Tensor | None, items: list, r: int, r_pad: int, q: int,
                    num_keys: int, shape: tuple[int, int] | None) -> None:
        """Fill the host rows of a forward (token ids from a list; a tensor's or None leave the
        ids columns 0)."""
        # Request state on the host, padded: padding requests sit at positions 0..q-1 of the
        # scratch block, with token id 0; a request of n < q tokens (a prefill) has q - n padding
        # tokens (id 0) at positions seq_len.. (its own unused slots, or the scratch block past
        # its table: every table column a position < num_keys can reach is written here)
        if self.copied is not None:
            self.copied.synchronize()  # the previous forward's copy has left the buffer
        rows = self.host_rows
        rows[:r, 0] = [it.start_pos for it in items]
        rows[:r, 1] = [it.seq_len for it in items]
        rows[r:r_pad, 0] = 0
        rows[r:r_pad, 1] = q
        rows[:r_pad, self.ids_offset : self.ids_offset + q] = 0
        # the block tables: an SWA table's entries before swa_start are the scratch block (a
        # long context copies its window, not its length, per SWA group); a row that holds the
        # same request as the last forward gets only its new block ids (engine/host_rows.py)
        self.tables.write(items, r_pad, num_keys // self.block_size)
        if input_ids is None or isinstance(input_ids, torch.Tensor):
            return
        if shape is None:  # decode phase: every request q tokens, in order
            rows[:r, self.ids_offset : self.ids_offset + q] = np.asarray(input_ids, dtype=np.int64).reshape(r, q)
        else:  # a padded prefill: request i's num_tokens, then zeros
            offset = 0
            for i, it in enumerate(items):
                rows[i, self.ids_offset : self.ids_offset + it.num_tokens] = input_ids[offset : offset + it.num_tokens]
                offset += it.num_tokens

    def _wait_for_staged_upload(self) -> None:
        """Order the current stream after a side-stream upload not waited for yet (it writes
        ``state``)."""
        if self._staged_upload is not None:
            torch.cuda.current_stream(self.device).wait_event(self._staged_upload)
            self._staged_upload = None

    def _upload(self, r_pad: int, on_side_stream: bool) -> None:
        """Ship the host rows ``[:r_pad]`` into ``state``: on the current stream (after any
        side-stream upload not waited for), or, on CUDA with ``on_side_stream``, on a side stream
        that first waits for the current stream's work so far (the last replay read ``state``).
        Then the current stream must :meth:`_wait_for_staged_upload` before it writes ``state``
        or replays."""
        if self.copied is None or not on_side_stream:
            self._wait_for_staged_upload()
            self.state[:r_pad].copy_(self.host_state[:r_pad], non_blocking=True)
            if self.copied is not None:
                self.copied.record()
            return
        side = self._upload_stream
        if side is None:
            side = self._upload_stream = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # FIFO behind any upload not waited for yet
            self.state[:r_pad].copy_(self.host_state[:r_pad], non_blocking=True)
            self.copied.record(side)
            self._staged_upload = torch.cuda.Event()
            self._staged_upload.record(side)

    @torch.inference_mode()
    def forward(self, input_ids: list[int] | torch.Tensor, items: list, tap_layer_ids: tuple[int, ...],
                is_causal: bool, context_store: ContextStore | None = None,
                tail_ids: torch.Tensor | None = None, device_start: DeviceStart | None = None,
                shape: tuple[int, int] | None = None,
                copy_hidden: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as ``ModelRunner.forward`` for a batch where ``can_run`` holds
        (``context_store``: captured into the graph, after the forward; ``tail_ids``,
        ``device_start``: written into the request rows after their upload; ``copy_hidden``:
        False returns a view of the static output, which any later replay of this runner's
        graphs may overwrite), or a prefill of :meth:`prefill_shape` ``shape`` (token ids a
        list; no context store)."""
        r, r_pad, q, num_keys = self._batch(items, shape)
        assert shape is None or (not isinstance(input_ids, torch.Tensor) and context_store is None
                                 and tail_ids is None and device_start is None)
        self._write_rows(input_ids, items, r, r_pad, q, num_keys, shape)
        self._upload(r_pad, False)
        # token ids given as a tensor (the verify batch: bonus + drafts, on the device) are
        # copied tensor to tensor, never read back on the host (no sync on the step path)
        is_tensor = isinstance(input_ids, torch.Tensor)
        if q == 1 and is_tensor and tail_ids is None and device_start is None:
            self.decode_ids[:r].copy_(input_ids.view(r))
        else:
            if is_tensor:
                self.state[:r, self.ids_offset : self.ids_offset + q].copy_(input_ids.view(r, q))
            if tail_ids is not None:  # one copy (the verify's drafts after the bonus uploaded above)
                self.state[:r, self.ids_offset + q - tail_ids.shape[1] : self.ids_offset + q].copy_(tail_ids)
            if device_start is not None:  # one launch
                rewind_rows(self.state, device_start.accepted, device_start.tokens, self.ids_offset)
            if q == 1:  # a forward of one token a request reads its ids from decode_ids
                self.decode_ids[:r_pad].copy_(self.state[:r_pad, self.ids_offset])
        return self._replay(items, r_pad, q, num_keys, is_causal, tuple(tap_layer_ids), context_store, shape,
                            copy_hidden)

    @torch.inference_mode()
    def stage_decode(self, items: list, tap_layer_ids: tuple[int, ...]) -> StagedDecode:
        """Upload the rows of a one-token-a-request forward (``can_run`` holds, every item one
        token) before its token ids exist: on CUDA on a side stream behind the current stream's
        work so far, so the copy runs while the current stream computes those ids. The caller
        writes the ids into ``staged.ids`` (the lm_head's argmax ``also_into``) or passes them to
        :meth:`run_staged`, which replays; until then, nothing else may replay here."""
        r, r_pad, q, num_keys = self._batch(items, None)
        assert q == 1, "stage_decode takes forwards of one token a request"
        self._write_rows(None, items, r, r_pad, q, num_keys, None)
        self._upload(r_pad, stage_uploads_on_side_stream)
        return StagedDecode(list(items), r_pad, num_keys, tuple(tap_layer_ids), self.decode_ids[:r])

    @torch.inference_mode()
    def run_staged(self, staged: StagedDecode, ids: torch.Tensor,
                   copy_hidden: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the forward :meth:`stage_decode` staged, with token ids ``ids [R]`` int64 on the
        device (``staged.ids`` itself where they were written there: no copy) -> ``forward``'s
        outputs."""
        if ids.data_ptr() != staged.ids.data_ptr():
            staged.ids.copy_(ids.view(-1))
        self._wait_for_staged_upload()
        return self._replay(staged.items, staged.r_pad, 1, staged.num_keys, True, staged.tap_layer_ids, None, None,
                            copy_hidden)

    def _replay(self, items: list, r_pad: int, q: int, num_keys: int, is_causal: bool,
                tap_layer_ids: tuple[int, ...], context_store: ContextStore | None, shape: tuple[int, int] | None,
                copy_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of the rows in ``state`` (and ``decode_ids``): its graph's replay (captured
        first where missing; on the CPU the same padded forward, eagerly) -> its outputs."""
        r = len(items)
        if self.device.type != "cuda":  # CPU: the same padded forward, eagerly (tests the padding)
            hidden, taps = self._run_model(r_pad, q, num_keys, is_causal, tap_layer_ids, context_store)
        else:
            key = (r_pad, q, num_keys, is_causal, tap_layer_ids, context_store is not None)
            kind = key[1:2] + key[3:]
            captured = self.graphs.get(key)
            if captured is None:
                captured = self.graphs[key] = self._capture(r_pad, q, num_keys, is_causal,
                                                            tap_layer_ids, context_store)
                self._add_kind(kind, context_store, is_prefill=shape is not None)
            elif shape is None and kind in self.prefill_only_kinds:  # a prefill's graph, decoding
                self.prefill_only_kinds.discard(kind)
            captured.graph.replay()
            hidden, taps = captured.hidden, captured.taps
        # copied out: the graph's next replay overwrites its static outputs
        if shape is None or r == 1:  # decode phase (every request q tokens), or one prefill
            n = r * q if shape is None else items[0].num_tokens
            hidden = hidden[:n].clone() if copy_hidden else hidden[:n]
            return hidden, taps[:n].clone() if taps is not None else None
        rows_out = self._real_rows(items, q)
        return rows_out(hidden), rows_out(taps) if taps is not None else None

    def _real_rows(self, items: list, q: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The rows of a padded prefill's real tokens, in flat order, of its ``[R_pad * q, ...]``
        outputs (each request ``q`` rows, its first ``num_tokens`` real)."""
        index = torch.tensor([i * q + j for i, it in enumerate(items) for j in range(it.num_tokens)])
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        return lambda t: t.index_select(0, index)
