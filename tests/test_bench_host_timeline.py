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
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \(([\d.]+)-([\d.]+)\) \| n/a \| n/a \| n/a \|$", done.stdout, re.M)
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


def test_gap_steps_list_each_step_with_its_block_work():
    # a 60-token prompt: its fourth block fills at position 63 and the fifth is needed from 64,
    # both inside the 20 decode steps of 21 new tokens (one token a step)
    done = _run("--context", "60", "--new-tokens", "21", "--rounds", "1", "--gaps", "--gap-batches", "1,3",
                "--no-profile", "--gap-steps")
    assert done.returncode == 0, done.stderr[-3000:]
    counts = dict(re.findall(r"^\| (\d+) \| (\d+) \| [\d.]+ \(", done.stdout, re.M))
    tables = re.split(r"^batch (\d+), step by step$", done.stdout, flags=re.M)[1:]
    assert [tables[i] for i in range(0, len(tables), 2)] == ["1", "3"], done.stdout[-3000:]
    for batch, text in zip(tables[0::2], tables[1::2]):
        rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| n/a \| (\d+) \| (\d+) \|$", text, re.M)
        assert [int(r[0]) for r in rows] == list(range(int(counts[batch]))), text
        allocated, registered = (sum(int(r[k]) for r in rows) for k in (2, 3))
        # every request of the batch crosses the same boundaries (equal prompts) in these windows
        assert allocated > 0 and registered > 0 and allocated % int(batch) == registered % int(batch) == 0, text
        assert all(float(r[1]) > 0 for r in rows)


def test_gap_steps_need_gaps():
    done = _run("--gap-steps")
    assert done.returncode == 2 and "--gap-steps lists the steps of --gaps: add --gaps" in done.stderr


def test_between_replays_lists_the_eager_ops_and_idle_time_between_two_replays():
    sys.path.insert(0, str(BENCH))
    from host_timeline import between_replays

    graph = {"layer", "gemm"}  # "gemm" also runs eagerly (the lm_head) after each replay
    gpu = []
    t = 0.0
    for step in range(5):
        for _ in range(25):  # a replay of PDL kernels: each starts before the last one ends
            gpu.append((t, t + 2.0, "layer"))
            t += 1.5
        end = t + 0.5
        gpu += [(end + 3.0, end + 83.0, "gemm"), (end + 84.0, end + 86.0, "finish"),
                (end + 87.5, end + 89.0, "Memcpy DtoH"), (end + 90.0, end + 92.0, "Memcpy HtoD")]
        t = end + 96.0 + step % 2  # the next replay starts 4 or 5 us after the upload
    [(rows, segments, span, period)] = between_replays(gpu, graph)
    assert segments == 4
    names = [r[0] for r in rows]
    assert names == ["gemm", "finish", "Memcpy DtoH", "Memcpy HtoD", "(next replay starts)"]
    gaps = [round(r[1], 3) for r in rows]
    assert gaps == [3.0, 1.0, 1.5, 1.0, 5.0]  # the median of 4, 5, 4, 5: the upper middle
    assert [round(r[2], 3) for r in rows[:-1]] == [80.0, 2.0, 1.5, 2.0]
    assert round(span, 3) == 24 * 1.5 + 2.0
    assert period > span + 92


def test_sequence_on_the_cpu_has_no_replays():
    done = _run("--new-tokens", "5", "--rounds", "1", "--sequence")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target-only decode: no two graph replays in the profile" in done.stdout, done.stdout[-3000:]
