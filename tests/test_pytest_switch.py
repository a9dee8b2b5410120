"""``pytest --switch module:attr=value`` (tests/conftest.py): the run's tests see the setting, a
bad switch stops the run with a usage error naming the fix, and without it nothing changes. A GPU
run uses it to test a candidate default (``gpu_check.sh``'s ``engine_cuda_tests``) before the
default changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from laguna_dflash.kernels import staged_gemv

REPO = Path(__file__).resolve().parents[1]
# a test that pins the default one-row config: it fails when the switch below is in effect
PINNED = "tests/test_kernel_staged_gemv.py::test_default_config_and_shared_memory"
SWITCH = "laguna_dflash.kernels.staged_gemv:ONE_ROW_CONFIG=[8,512,12,4]"


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_switch_reaches_the_tests_and_a_bad_one_names_the_fix():
    assert _pytest(PINNED).returncode == 0
    switched = _pytest(PINNED, "--switch", SWITCH)
    assert switched.returncode == 1 and "1 failed" in switched.stdout, switched.stdout[-2000:]
    assert "stages: 12 != 8" in switched.stdout  # the switched config, not the default
    # the header names it; a switch to the value it has changes nothing
    same = _pytest(PINNED, "-v", "--switch", "laguna_dflash.kernels.staged_gemv:ONE_ROW_CONFIG=[8,512,8,4]")
    assert same.returncode == 0 and "switches: laguna_dflash.kernels.staged_gemv:ONE_ROW_CONFIG" in same.stdout
    bad = _pytest(PINNED, "--switch", "laguna_dflash.kernels.staged_gemv:NO_SUCH_CONFIG=1")
    assert bad.returncode == 4, bad.stdout + bad.stderr
    assert "--switch" in bad.stderr and "NO_SUCH_CONFIG" in bad.stderr and "module:attr=value" in bad.stderr
    assert tuple(staged_gemv.ONE_ROW_CONFIG) == (8, 512, 8, 4)  # this process: untouched
