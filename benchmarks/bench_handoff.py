"""What does handing data from one step to the next cost on the GPU: a kernel boundary (with and
without programmatic dependent launch) or a grid barrier inside one persistent kernel?

The decode step's remaining gap to the bandwidth floor is ~20 us a layer of latency-bound steps
(docs/PERFORMANCE.md, tenth and eleventh passes), ~8 dependent hand-offs a layer. Folding a step
into its neighbour with a last-arriving program did not beat a PDL boundary (eleventh pass). A
persistent layer kernel would replace boundaries by grid barriers; this measures the two
hand-offs alone, with the same work per step: every program reads a value another program wrote
in the previous step (an L2 round trip) and writes its own.

* ``launch``: one kernel per step, normal launches, captured in a CUDA graph.
* ``pdl``: the same with programmatic dependent launch (``griddepcontrol.wait`` before the read,
  ``launch_dependents`` right after it), as the decode kernels do.
* ``barrier``: one kernel running every step; between steps each program releases an arrival
  counter (one ``atomic_add`` with release semantics) and spins on it (acquire) until every
  program of the grid has arrived. Needs the whole grid resident (grids <= the SM count here).

Prints microseconds per step, from graph replays (median of 5 x 20 replays), after checking the
values the chain computed.

    python benchmarks/bench_handoff.py
    TRITON_INTERPRET=1 python benchmarks/bench_handoff.py --device cpu --tiny  # wiring check
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels.jit import jit_functions  # noqa: E402

if TYPE_CHECKING:
    import triton.language as tl


def _step_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    # one hand-off: read the value the next program wrote last step (another SM's write: through
    # L2), write it plus one
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    v = tl.load(src_ptr + (pid + 1) % tl.num_programs(0), cache_modifier=".cg")
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(dst_ptr + pid, v + 1)


def _persistent_kernel(buf_ptr, count_ptr, NUM_STEPS: tl.constexpr):
    # NUM_STEPS hand-offs in one launch; buf [2, G] ping-pong, count_ptr zero at launch
    pid = tl.program_id(0)
    g = tl.num_programs(0)
    for step in range(NUM_STEPS):
        src = buf_ptr + (step % 2) * g
        dst = buf_ptr + ((step + 1) % 2) * g
        v = tl.load(src + (pid + 1) % g, cache_modifier=".cg")
        tl.store(dst + pid, v + 1)
        tl.debug_barrier()  # the program's store precedes its release
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        target = (step + 1) * g
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@functools.cache
def _kernels():
    ns = jit_functions(__name__, (_step_kernel, _persistent_kernel))
    return ns["_step_kernel"], ns["_persistent_kernel"]


def run_chain(kind: str, grid: int, steps: int, device: str) -> tuple[torch.Tensor, object]:
    """Build the chain; returns (the buffer holding the last step's values, a callable running it
    once). The values after ``steps`` steps from zeros are all ``steps``."""
    step_kernel, persistent = _kernels()
    buf = torch.zeros(2, grid, dtype=torch.int32, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    if kind == "barrier":
        def run():
            buf.zero_()
            count.zero_()
            persistent[(grid,)](buf, count, NUM_STEPS=steps, num_warps=1)
    else:
        pdl = kind == "pdl"
        extra = {"launch_pdl": True} if pdl else {}

        def run():
            buf.zero_()
            for s in range(steps):
                step_kernel[(grid,)](buf[s % 2], buf[(s + 1) % 2], PDL=pdl, num_warps=1, **extra)
    return buf[steps % 2], run


def time_us_per_step(kind: str, grid: int, steps: int) -> float:
    out, run = run_chain(kind, grid, steps, "cuda")
    run()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    if not bool((out == steps).all()):
        raise RuntimeError(f"{kind} x {grid}: wrong values {out.tolist()[:8]}")
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (20 * steps))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="CPU wiring check: a few steps, one program")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--grids", default="8,32,132")
    args = ap.parse_args()
    if args.device == "cpu":
        # the interpreter runs programs one after another: a grid barrier waits forever for more
        # than one program, so the check uses one (and three for the kernel chains)
        for kind, grid in (("launch", 3), ("barrier", 1)):
            out, run = run_chain(kind, grid, 5, "cpu")
            run()
            print(f"| tiny {kind} x {grid} | {'ok' if bool((out == 5).all()) else 'wrong'} |")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} steps a chain\n")
    print("| programs | launch us/step | PDL us/step | grid barrier us/step |\n|---:|---:|---:|---:|")
    for grid in (int(g) for g in args.grids.split(",")):
        row = [time_us_per_step(kind, grid, args.steps) for kind in ("launch", "pdl", "barrier")]
        print(f"| {grid} | " + " | ".join(f"{us:.2f}" for us in row) + " |")


if __name__ == "__main__":
    main()
