"""benchmarks/host_timeline.py on the CPU (a wiring check at small widths; its times are the GPU's,
docs/PERFORMANCE.md): ``--gaps`` times the DFlash step's host path, from the step's sync to the
next verify's launch, at each ``--gap-batches`` size, with the drafts queued ahead."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from cpu_bench import BENCH


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "host_timeline.py"), "--device", "cpu", "--layers", "2",
                           "--context", "64", *args], capture_output=True, text=True, timeout=600, cwd=BENCH,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_gaps_table_has_a_row_a_batch_size_with_the_host_path():
    done = _run("--new-tokens", "9", "--rounds", "1", "--gaps", "--gap-batches", "1,3")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \(([\d.]+)-([\d.]+)\) \| n/a \| n/a \|$", done.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "3"], done.stdout[-3000:]
    for _, steps, median, low, high in rows:
        # 9 new tokens at acceptance length 1: 8 decode steps, all but the first with drafts ahead
        assert int(steps) == 7
        # us: host work only (~0.2-0.3 ms here); a window that spanned the verify's forward on
        # the CPU too would read several ms
        assert 0 < float(low) <= float(median) <= float(high) and float(median) < 2_000


def test_gc_freeze_and_the_collections_during_each_batch_size():
    done = _run("--new-tokens", "9", "--rounds", "1", "--gaps", "--gap-batches", "1,3", "--gc-freeze",
                "--no-profile")
    assert done.returncode == 0, done.stderr[-3000:]
    frozen = re.search(r"^gc.freeze\(\): (\d+) objects of the start-up heap frozen; a full collection took "
                       r"([\d.]+) ms before, ([\d.]+) ms after \(median of 3\)$", done.stdout, re.M)
    assert frozen and int(frozen.group(1)) > 10_000, done.stdout[-3000:]  # modules, the engine
    # the frozen heap is not scanned: a full collection then walks only what was made since
    assert float(frozen.group(3)) < float(frozen.group(2)), frozen.group(0)
    lines = re.findall(r"^gc during batch (\d+): gen 0: (\d+)(?: \(longest \d+ us\))?, gen 1: \d+.*, gen 2: \d+",
                       done.stdout, re.M)
    assert [b for b, _ in lines] == ["1", "3"], done.stdout[-3000:]
    assert "profiled" not in done.stdout  # --no-profile


def test_bad_gap_batches_name_the_flag():
    done = _run("--gaps", "--gap-batches", "1,0")
    assert done.returncode == 2 and "--gap-batches takes batch sizes >= 1" in done.stderr
