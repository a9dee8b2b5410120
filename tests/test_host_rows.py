"""engine/host_rows.py: a graph runner's block-table rows written incrementally equal the rows
rewritten from the request lists (the reference) through every change a row sees: a table that
grows, a key bucket that grows or shrinks, a window that slides, a request that leaves (padding)
or is admitted again (new lists), another writer (``forget``). The engine-level check, every
forward of a randomised load with preemption and the prefix cache, is in
tests/test_engine_stress.py (``RowsChecked``)."""

from __future__ import annotations

import numpy as np
import pytest

from laguna_dflash.engine import host_rows
from laguna_dflash.engine.runner import ForwardItem

NUM_TABLES, MAX_BLOCKS, SCRATCH = 3, 16, 99


def _reference(items: list, r_pad: int, nb: int) -> np.ndarray:
    rows = np.full((8, 2 + NUM_TABLES * MAX_BLOCKS + 4), -1, dtype=np.int64)
    tables = host_rows.RowTables(rows, NUM_TABLES, MAX_BLOCKS, SCRATCH)
    for i in range(r_pad):
        it = items[i] if i < len(items) else None
        lists = (it.block_table, *it.swa_block_tables) if it else None
        spans = tuple((min(it.swa_start, nb) if t else 0, min(len(b), nb)) for t, b in enumerate(lists)) if it else ()
        tables._rewrite(i, lists, spans, nb)
    return rows


class Table:
    """A request's lists, changed the ways the scheduler changes them."""

    def __init__(self, first_block: int) -> None:
        self.next = first_block
        self.full, self.swa, self.swa_start = [], ([], []), 0

    def grow(self, n: int) -> None:
        for table in (self.full, *self.swa):
            table += list(range(self.next, self.next + n))
            self.next += n

    def slide(self, first: int) -> None:  # trim_window: entries before the new start -> null
        for table in self.swa:
            table[self.swa_start : first] = [0] * (first - self.swa_start)
        self.swa_start = first

    def readmit(self) -> None:  # release, then admission: new lists
        self.full, self.swa, self.swa_start = [], ([], []), 0

    def grow_sliding(self, n: int) -> None:  # the sliding tables alone (any list may grow)
        for table in self.swa:
            table += list(range(self.next, self.next + n))
            self.next += n

    def new_sliding_lists(self) -> None:  # other sliding lists, as long, the full list kept
        self.swa = tuple([b + 1000 for b in table] for table in self.swa)

    def item(self) -> ForwardItem:  # a new tuple of the same lists each forward, as forward_item
        return ForwardItem(1, 0, 1, self.full, tuple(self.swa), self.swa_start)


@pytest.mark.parametrize("incremental", [True, False])
def test_rows_equal_a_full_rewrite_through_every_change(monkeypatch, incremental):
    monkeypatch.setattr(host_rows, "incremental", incremental)
    rows = np.full((8, 2 + NUM_TABLES * MAX_BLOCKS + 4), -1, dtype=np.int64)
    tables = host_rows.RowTables(rows, NUM_TABLES, MAX_BLOCKS, SCRATCH)
    a, b, c = Table(100), Table(200), Table(300)
    a.grow(2)
    b.grow(3)
    c.grow(1)
    end = 2 + NUM_TABLES * MAX_BLOCKS
    rewrites = []
    rewrite = host_rows.RowTables._rewrite
    monkeypatch.setattr(host_rows.RowTables, "_rewrite",
                        lambda self, i, *args: (rewrites.append(i), rewrite(self, i, *args))[1])
    steps = [  # (requests of the forward, r_pad, nb), each after the changes listed
        ("start", [a, b], 4, 4),
        ("a grows, b is unchanged", [a, b], 4, 4),
        ("the key bucket grows", [a, b], 4, 8),
        ("a's window slides", [a, b], 4, 8),
        ("the key bucket shrinks below b's table", [a, b], 4, 2),
        ("b leaves: its row is padding", [a], 4, 2),
        ("c takes b's row", [a, c], 4, 2),
        ("c is admitted again: new lists, as long", [a, c], 4, 2),
        ("a is admitted again (new lists) and grows", [a, c], 4, 8),
        ("another writer", [a, c], 4, 8),
        ("nothing changed", [a, c], 4, 8),
        ("fewer padding rows", [a, c], 2, 8),
        ("c's sliding tables grow alone", [a, c], 2, 8),
        ("c's sliding lists are others, as long", [a, c], 2, 8),
    ]
    for name, reqs, r_pad, nb in steps:
        if name == "a grows, b is unchanged":
            a.grow(1)
        elif name == "a's window slides":
            a.grow(2)
            a.slide(2)
        elif name == "a is admitted again (new lists) and grows":
            a.readmit()
            a.grow(3)
        elif name == "c is admitted again: new lists, as long":
            c.readmit()
            c.grow(2)  # same window start, bucket and length: only the lists' identity tells
        elif name == "c's sliding tables grow alone":
            c.grow_sliding(1)
        elif name == "c's sliding lists are others, as long":
            c.new_sliding_lists()
        elif name == "another writer":
            rows[:, 2:end] = 7
            tables.forget()
        items = [r.item() for r in reqs]
        want = _reference(items, r_pad, nb)
        rewrites.clear()
        tables.write(items, r_pad, nb)
        assert (rows[:r_pad, 2:end] == want[:r_pad, 2:end]).all(), name
        if incremental:  # only rows whose lists, bucket or window changed are rewritten
            expected = {"start": [0, 1, 2, 3], "a grows, b is unchanged": [], "the key bucket grows": [0, 1, 2, 3],
                        "a's window slides": [0], "the key bucket shrinks below b's table": [0, 1, 2, 3],
                        "b leaves: its row is padding": [1], "c takes b's row": [1],
                        "c is admitted again: new lists, as long": [1],
                        "a is admitted again (new lists) and grows": [0, 1, 2, 3],
                        "another writer": [0, 1, 2, 3], "nothing changed": [], "fewer padding rows": [],
                        "c's sliding tables grow alone": [], "c's sliding lists are others, as long": [1]}[name]
            assert rewrites == expected, name
        else:
            assert rewrites == list(range(r_pad)), name
