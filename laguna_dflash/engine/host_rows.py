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
        # per row: (nb, the table lists or None for a padding row, ((first, n) per table))
        self._held: list[tuple | None] = [None] * len(self.rows)

    def write(self, items: list, r_pad: int, nb: int) -> None:
        """Rows ``:r_pad`` for a forward of ``nb`` key blocks: row ``i < len(items)`` the tables
        of ``items[i]`` (``ForwardItem``), the rest padding (module docstring)."""
        held = self._held
        for i in range(r_pad):
            if i < len(items):
                it = items[i]
                tables = (it.block_table, *it.swa_block_tables)
                assert len(tables) == self.num_tables, "a hybrid layout's item needs every table"
                window = min(it.swa_start, nb)
                spans = tuple((window if t or it.is_window_table else 0, min(len(blocks), nb))
                              for t, blocks in enumerate(tables))
            else:
                tables, spans = None, ()
            before = held[i]
            if incremental and before is not None and before[0] == nb and self._grows(before, tables, spans):
                for t, blocks in enumerate(tables or ()):
                    n, was = spans[t][1], before[2][t][1]
                    if n > was:
                        col = 2 + t * self.max_blocks
                        self.rows[i, col + was : col + n] = blocks[was:n]
            else:
                self._rewrite(i, tables, spans, nb)
            held[i] = (nb, tables, spans)

    @staticmethod
    def _grows(before: tuple, tables: tuple | None, spans: tuple) -> bool:
        # the row holds these very lists (or padding again), each from the same first block and
        # up to at most its new end
        _, held_tables, held_spans = before
        if tables is None or held_tables is None:
            return tables is None and held_tables is None
        return all(a is b for a, b in zip(held_tables, tables)) and all(
            first == held_first and n >= held_n for (first, n), (held_first, held_n) in zip(spans, held_spans))

    def _rewrite(self, i: int, tables: tuple | None, spans: tuple, nb: int) -> None:
        row = self.rows[i]
        row[2 : 2 + self.num_tables * self.max_blocks] = 0
        for t in range(self.num_tables):
            col = 2 + t * self.max_blocks
            row[col : col + nb] = self.scratch_block
            if tables is not None:
                first, n = spans[t]
                row[col + first : col + n] = tables[t][first:n]
