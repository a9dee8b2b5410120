"""The block-table columns of a graph runner's request rows, written on the host incrementally.

A graphed forward reads one row a request (``cuda_graph.CUDAGraphRunner``: start position,
sequence length, each KV group's block table in ``max_blocks`` columns, token ids), filled in a
pinned host buffer and shipped with one copy. For a forward of ``nb = num_keys / block_size``
key blocks, table ``t`` of a row holds::

    columns [0, nb):           the scratch block, but [first, n) = the request's block ids
    columns [nb, max_blocks):  0

with ``n = min(len(table), nb)`` and ``first`` the window's first block (``swa_start``) for a
sliding group's table, else 0; a padding row (past the batch) holds only the scratch block.

Rewriting every row from its Python lists costs a numpy conversion per request and table: ~350 us
a step at batch 64 with a 1k context on a 2-core VM (the fill timed on its own, docs/PERFORMANCE.md,
sixty-fifth pass), during a DFlash step's host path, while the GPU has only the drafter block
queued. Between consecutive forwards a request's
row changes little: its table grows by a block every ``block_size`` tokens. So a row that holds
the same request's tables (the same list objects), with the same ``nb`` and window start, gets
only its new block ids. That is exact because the scheduler only appends to a table list at or
past ``swa_start`` (``_reserve``), rewrites entries before a new ``swa_start`` (``trim_window``,
which moves ``first``: a full rewrite), and gives a request new lists when it is admitted again
(``release``). Anything else that writes the rows must call :meth:`RowTables.forget`.
"""

from __future__ import annotations

from operator import is_

import numpy as np

# False: every row rewritten from its lists in every forward (the reference the tests compare
# with, and an A/B switch for host_timeline.py)
incremental = True


class RowTables:
    """The block-table columns ``[2, 2 + num_tables * max_blocks)`` of ``rows`` (int64
    ``[max_rows, width]``), and what each row holds of which lists."""

    def __init__(self, rows: np.ndarray, num_tables: int, max_blocks: int, scratch_block: int) -> None:
        self.rows = rows
        self.num_tables = num_tables
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.forget()

    def forget(self) -> None:
        """Trust no row: the next :meth:`write` rewrites each one (after another writer)."""
        # per row: (nb, None) for a padding row, else (nb, the full table's list, the sliding
        # tables' lists, the window start, is_window_table, each list's length when written)
        self._held: list[tuple | None] = [None] * len(self.rows)

    def write(self, items: list, r_pad: int, nb: int) -> None:
        """Rows ``:r_pad`` for a forward of ``nb`` key blocks: row ``i < len(items)`` the tables
        of ``items[i]`` (``ForwardItem``), the rest padding (module docstring)."""
        # The common case, a row that holds the same lists at the same nb and window, costs a
        # few comparisons: ~64 of them a DFlash step at batch 64 run while the GPU has only the
        # drafter block queued (docs/PERFORMANCE.md, sixty-sixth pass)
        held = self._held
        num_items = len(items)
        for i in range(r_pad):
            before = held[i]
            if i >= num_items:  # padding
                if not (incremental and before is not None and before[0] == nb and before[1] is None):
                    self._rewrite(i, None, (), nb)
                    held[i] = (nb, None)
                continue
            it = items[i]
            full, swa = it.block_table, it.swa_block_tables
            assert len(swa) + 1 == self.num_tables, "a hybrid layout's item needs every table"
            window = it.swa_start if it.swa_start < nb else nb
            lengths = (len(full), *map(len, swa))
            if (incremental and before is not None and before[0] == nb and before[1] is full
                    and before[3] == window and before[4] == it.is_window_table
                    and all(map(is_, before[2], swa))):
                if lengths == before[5]:
                    continue  # the same lists, none longer: the row is current
                if all(n >= was for n, was in zip(lengths, before[5])):  # only appended to
                    for t, blocks in enumerate((full, *swa)):
                        was, n = min(before[5][t], nb), min(lengths[t], nb)
                        if n > was:
                            col = 2 + t * self.max_blocks
                            self.rows[i, col + was : col + n] = blocks[was:n]
                    held[i] = (*before[:5], lengths)
                    continue
            spans = tuple((window if t or it.is_window_table else 0, min(n, nb)) for t, n in enumerate(lengths))
            self._rewrite(i, (full, *swa), spans, nb)
            held[i] = (nb, full, swa, window, it.is_window_table, lengths)

    def _rewrite(self, i: int, tables: tuple | None, spans: tuple, nb: int) -> None:
        row = self.rows[i]
        row[2 : 2 + self.num_tables * self.max_blocks] = 0
        for t in range(self.num_tables):
            col = 2 + t * self.max_blocks
            row[col : col + nb] = self.scratch_block
            if tables is not None:
                first, n = spans[t]
                row[col + first : col + n] = tables[t][first:n]
