"""benchmarks/gpu_check.sh, checked on the CPU before it costs device time: every stage named in
its header exists, every script and test file it runs exists, and every ``module:attr`` switch
it flips still resolves (a stage whose switch was removed would fail only on the GPU)."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
TEXT = SCRIPT.read_text()


def _cases() -> set[str]:
    body = TEXT[TEXT.index('case "$stage" in'):]
    return set(re.findall(r"^  ([a-z0-9-]+)\)", body, re.M))


def test_documented_stages_exist_and_unknown_ones_are_refused():
    documented = set(re.findall(r"^#   bash benchmarks/gpu_check\.sh ([a-z0-9-]+)", TEXT, re.M))
    assert documented and documented <= _cases(), sorted(documented - _cases())
    proc = subprocess.run(["bash", str(SCRIPT), "no-such-stage"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "unknown stage no-such-stage" in proc.stdout
    for stage in _cases():  # the refusal lists every stage
        assert stage in proc.stdout, stage


def test_every_file_it_runs_exists():
    paths = set(re.findall(r"\b((?:benchmarks|tests)/[\w./]+\.(?:py|sh))", TEXT))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (REPO / p).is_file())
    assert not missing, missing


def _switch_targets() -> set[str]:
    """Every ``laguna_dflash.module:attr[.attr]`` named, with the script's one-letter variables
    (``m=laguna_dflash.kernels.x`` / ``A=laguna_dflash.kernels.x:NAME``) substituted."""
    names = dict(re.findall(r"\b([A-Za-z])=\"?(laguna_dflash[\w.]*(?::[\w.]+)?)", TEXT))
    text = re.sub(r"\$([A-Za-z])\b", lambda m: names.get(m.group(1), m.group(0)), TEXT)
    return set(re.findall(r"(laguna_dflash(?:\.\w+)+:[A-Za-z_][\w.]*)", text))


def test_every_switch_resolves():
    targets = _switch_targets()
    assert len(targets) > 15
    for target in sorted(targets):
        module, attr = target.split(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            assert hasattr(obj, part), f"{target}: {part} is gone (gpu_check.sh would fail on the GPU)"
            obj = getattr(obj, part)
