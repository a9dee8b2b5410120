"""CUDA graphs for the drafter's context K/V precompute of a decode step.

After a DFlash step each request has ``a + 1 <= K + 1`` new target taps (the bonus token and the
accepted drafts); their context K/V (``combine_hidden_states``, the fused K|V GEMM, K-norm, RoPE,
cache writes: ``DFlashDraftModel.precompute_and_store_context_kv``) is a dozen small launches,
issued eagerly by the host each step. Here they replay from a graph captured per padded batch
size ``R_pad`` with ``M = K_max + 1`` rows per request:

* row ``i * M + j`` of the static ``features [R_pad * M, n_taps * H_t]`` holds request ``i``'s
  ``j``-th pending tap row, copied there by one ``index_select`` + ``index_copy_`` from the
  source tensors of the pending rows (engine/pending_taps.py; several sources are concatenated
  first);
* the static ``positions`` / ``slots`` give those rows' positions and drafter cache slots; rows
  without a pending tap (short requests, padding requests) get position 0 and the scratch slot,
  so they compute on stale finite features and write only the scratch block.

Positions, slots and the ``index_copy_`` destinations are built on the host in one reused pinned
buffer and shipped with one copy. Requests with more pending rows than ``M`` (after a prefill,
or several target-only steps in a row) take the eager path. On CPU the same padded computation
runs eagerly (what the tests compare against the unpadded path).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from .cuda_graph import capture_batch_sizes, capture_graph
from .kv_cache import KVCache
from .pending_taps import copy_rows, plan_rows

logger = logging.getLogger(__name__)


class ContextGraphRunner:
    """Replays ``drafter``'s context precompute for up to ``rows_per_request`` pending rows each.

    ``feature_dim``: width of a tap row (``n_taps * H_target``), in ``dtype``.
    """

    def __init__(self, drafter: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 max_num_seqs: int, rows_per_request: int, feature_dim: int, dtype: torch.dtype) -> None:
        self.drafter = drafter
        self.kv_cache = kv_cache
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.rows_per_request = rows_per_request
        max_rows = self.batch_sizes[-1] * rows_per_request
        self.features = torch.zeros(max_rows, feature_dim, dtype=dtype, device=device)
        pin = device.type == "cuda"
        # rows: positions, slots (R_pad * M each), then for the N real rows: destination rows in
        # ``features`` and rows of their source tensors (engine/pending_taps.plan_rows)
        self.host_index = torch.zeros(4, max_rows, dtype=torch.long, pin_memory=pin)
        self.host_rows = self.host_index.numpy()
        self.copied = torch.cuda.Event() if pin else None  # the last copy out of host_index
        self.index = torch.zeros(4, max_rows, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.is_broken = False  # a capture failed: the eager path from then on

    def can_run(self, pending: list) -> bool:
        """Every request has at most ``rows_per_request`` pending rows and the batch fits."""
        return (not self.is_broken and 0 < len(pending) <= self.batch_sizes[-1]
                and all(s.num_pending <= self.rows_per_request for s in pending))

    def _run_model(self, num_rows: int) -> None:
        context = self.drafter.combine_hidden_states(self.features[:num_rows])
        self.drafter.precompute_and_store_context_kv(
            context, self.index[0, :num_rows], self.index[1, :num_rows], self.kv_cache.layers)

    @torch.inference_mode()
    def run(self, pending: list, slots_of) -> None:
        """Write the context K/V of every request's pending rows; ``slots_of(seq, start, n)``
        gives a request's drafter cache slots (``[n]`` int64 numpy) for positions ``start ..``."""
        r, m = len(pending), self.rows_per_request
        r_pad = next(b for b in self.batch_sizes if b >= r)
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the host buffer
        rows = self.host_rows
        rows[0, : r_pad * m] = 0
        rows[1, : r_pad * m] = self.kv_cache.scratch_slot
        for i, s in enumerate(pending):
            n, start = s.num_pending, s.pending_start
            rows[0, i * m : i * m + n] = range(start, start + n)
            rows[1, i * m : i * m + n] = slots_of(s, start, n)
        sources, copy_rows_host = plan_rows(pending, [i * m for i in range(r)])
        num_real = copy_rows_host.shape[1]
        rows[2:, :num_real] = copy_rows_host
        self.index.copy_(self.host_index, non_blocking=True)  # whole (contiguous, a few KB)
        if self.copied is not None:
            self.copied.record()
        copy_rows(self.features, sources, self.index[2:, :num_real])
        if self.device.type != "cuda":  # CPU: the same padded computation, eagerly
            self._run_model(r_pad * m)
            return
        graph = self.graphs.get(r_pad) or self._capture(r_pad)
        if graph is None:  # the capture failed: this step's context eagerly
            self._run_model(r_pad * m)
            return
        graph.replay()

    def _capture(self, r_pad: int, build_first: bool = True) -> torch.cuda.CUDAGraph | None:
        """Capture the graph of ``r_pad`` requests (run eagerly first, as ``capture_graph`` does; ``build_first``:
        its Triton kernels built in parallel before, as ``capture_graph``); ``None`` and the
        eager path from then on if capturing fails."""
        m = self.rows_per_request
        try:
            graph, _, self.pool = capture_graph(lambda: self._run_model(r_pad * m), self.device,
                                                self.pool, build_first)
        except Exception as e:  # noqa: BLE001 - the drafter's context only: keep serving eagerly
            self.is_broken = True
            logger.warning("capturing the drafter-context CUDA graph failed, precomputing the "
                           "context eagerly from now on: %s", e)
            return None
        self.graphs[r_pad] = graph
        logger.info("captured a drafter-context CUDA graph: %d requests x %d rows", r_pad, m)
        return graph

    def missing_sizes(self) -> list[int]:
        """The padded batch sizes :meth:`capture_all` would capture."""
        return [] if self.is_broken else [r for r in self.batch_sizes if r not in self.graphs]

    def forwards_to_capture(self) -> list[Callable[[], object]]:
        """The computations :meth:`capture_all` would capture (for
        ``cuda_graph.build_kernels_ahead``)."""
        return [functools.partial(self._run_model, r * self.rows_per_request)
                for r in self.missing_sizes()]

    @torch.inference_mode()  # as run(), whose graphs these are
    def capture_all(self, progress=None) -> int:
        """Capture :meth:`missing_sizes` (at start-up: no later step waits for a capture), on
        padding rows (position 0, the scratch slot). ``progress``: a tqdm bar, advanced per
        graph. -> graphs captured."""
        if self.device.type != "cuda" or self.is_broken:
            return 0
        if self.copied is not None:
            self.copied.synchronize()
        self.host_rows[0] = 0
        self.host_rows[1] = self.kv_cache.scratch_slot
        self.index.copy_(self.host_index)
        count = 0
        for r in self.missing_sizes():
            count += self._capture(r, build_first=False) is not None  # built ahead already
            if progress is not None:
                progress.update(1)
        return count
