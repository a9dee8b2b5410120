"""Run a script of benchmarks/ as its CPU wiring check and read its markdown table (the tests
of the XS-2.1 A/B scripts: their times are the GPU's, docs/PERFORMANCE.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run_cpu_bench(script: str, *args: str) -> str:
    """stdout of ``benchmarks/<script> --device cpu --layers 2 --hidden 256 <args>`` (one thread),
    which must exit 0."""
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--device", "cpu", "--layers", "2", "--hidden", "256",
         *args], capture_output=True, text=True, timeout=600, cwd=BENCH,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of every markdown table row of ``stdout``, header rows included, rules not."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines()
            if line.startswith("| ") and "---" not in line]


def printed_ratio_tolerance(num: float, den: float, num_step: float, den_step: float,
                            ratio_step: float) -> float:
    """How far a printed ratio may sit from the quotient of its printed operands.

    Each printed figure is rounded to its last digit (``*_step``: 0.1 for ``:.1f``), so it is
    off by at most half a step. Carried through the quotient, d(n/d) = dn/d + n*dd/d^2, which
    adds to the ratio's own half step (a first-order bound, with a little slack on top).
    """
    return (ratio_step + num_step / den + num * den_step / den**2) / 2 * 1.01 + 1e-12
