"""benchmarks/gpu_check.sh, checked on the CPU before it costs device time: every stage named in
its header exists, every script and test file it runs exists, and every ``module:attr`` switch
it flips still resolves (a stage whose switch was removed would fail only on the GPU)."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
TEXT = SCRIPT.read_text()


def _cases() -> set[str]:
    body = TEXT[TEXT.index('case "$stage" in'):]
    return set(re.findall(r"^  ([a-z0-9-]+)\)", body, re.M))


def test_no_stage_label_is_repeated():
    """bash runs the first matching case: a second copy of a stage would never run."""
    body = TEXT[TEXT.index('case "$stage" in'):]
    labels = re.findall(r"^  ([a-z0-9-]+)\)", body, re.M)
    assert len(labels) == len(set(labels)), sorted({x for x in labels if labels.count(x) > 1})


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


# The switches of the stages that run from .ab/old (a carried archive of an older commit, where
# code since removed still is): they resolve at that commit, not in this tree.
_OLD_TREE_COMMIT = "5d91d44"
_OLD_TREE_STAGES = ("pass109", "pass110")
_OLD_TREE_SWITCHES = {"laguna_dflash.models.layers:staged_o_proj_max_rows",
                      "laguna_dflash.kernels.staged_gemv:MULTI_ROW_CONFIG"}


def _stage_body(stage: str) -> str:
    body = TEXT[TEXT.index('case "$stage" in'):]
    start = body.index(f"\n  {stage})\n")
    return body[start : body.index(";;", start)]


def test_every_switch_resolves():
    targets = _switch_targets() - _OLD_TREE_SWITCHES
    assert len(targets) > 15
    for target in sorted(targets):
        module, attr = target.split(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            assert hasattr(obj, part), f"{target}: {part} is gone (gpu_check.sh would fail on the GPU)"
            obj = getattr(obj, part)


def test_old_tree_switches_resolve_at_its_commit_and_run_only_from_its_tree():
    """pass109 / pass110 flip settings of the staged o_proj's 2-4 row kernels, removed from this
    tree: each must name an attribute that the commit archived into .ab/old assigns, and be used
    only by the stages that run from .ab/old."""
    assert f"git archive {_OLD_TREE_COMMIT} laguna_dflash benchmarks | tar -x -C .ab/old" in TEXT
    assert _OLD_TREE_SWITCHES <= _switch_targets()
    stages = [_stage_body(stage) for stage in _OLD_TREE_STAGES]
    for stage in stages:
        assert "cd .ab/old &&" in stage
    for line in TEXT.splitlines():
        for target in _OLD_TREE_SWITCHES:
            if target in line:  # in those stages' bodies only
                assert any(line in stage for stage in stages), line
    for target in sorted(_OLD_TREE_SWITCHES):
        module, attr = target.split(":")
        proc = subprocess.run(["git", "show", f"{_OLD_TREE_COMMIT}:{module.replace('.', '/')}.py"],
                              capture_output=True, text=True, cwd=REPO, timeout=60)
        if proc.returncode != 0:  # a clone without that history
            pytest.skip(f"commit {_OLD_TREE_COMMIT} is not in this clone: {proc.stderr.strip()}")
        assert re.search(rf"^{attr}\b[^=\n]*=", proc.stdout, re.M), f"{target} is not assigned at {_OLD_TREE_COMMIT}"
        assert not hasattr(importlib.import_module(module), attr), f"{target} is back in this tree: drop it here"


# shell helpers that run a benchmark script with the arguments they are given
_HELPER_SCRIPTS = {"goal_cell": "benchmarks/bench_gpu_xs.py", "base_goal_cell": "benchmarks/bench_gpu_xs.py"}


def _script_source(path: str, seen: set[str] | None = None) -> str:
    """The script's text and that of the sibling benchmark modules it imports (their argparse
    helpers, e.g. ``bench_gpu_xs.add_xs_pair_args``), recursively."""
    seen = set() if seen is None else seen
    if path in seen:
        return ""
    seen.add(path)
    text = (REPO / path).read_text()
    for module in re.findall(r"^(?:from|import) (\w+)", text, re.M):
        sibling = f"benchmarks/{module}.py"
        if (REPO / sibling).is_file():
            text += _script_source(sibling, seen)
    return text


def _benchmark_flags(text: str) -> list[tuple[str, str, str]]:
    """``(script, --flag, command)`` for every literal flag the script passes a benchmark script
    (continued lines joined; a command ends at a pipe, a redirect of stderr, ``;`` or ``&&``)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r"\b(benchmarks/\w+\.py)\b|\b(goal_cell|base_goal_cell) \S+", line):
            script = m.group(1) or _HELPER_SCRIPTS[m.group(2)]
            command = re.split(r"\s(?:\||2>&1|;|&&|\|\|)|\)\s*$|;;", line[m.end():])[0]
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command):
                found.append((script, flag, line.strip()[:100]))
    return found


def _unknown_flags(text: str) -> list[tuple[str, str, str]]:
    sources: dict[str, str] = {}
    unknown = []
    for script, flag, command in _benchmark_flags(text):
        source = sources.setdefault(script, _script_source(script))
        if f'"{flag}"' not in source and f"'{flag}'" not in source:
            unknown.append((script, flag, command))
    return unknown


def test_every_flag_it_passes_a_benchmark_exists():
    """A misspelt or removed flag would stop a stage only on the GPU, after its cold start."""
    assert len(_benchmark_flags(TEXT)) > 300
    unknown = _unknown_flags(TEXT)
    assert not unknown, unknown
    # the check catches one: a misspelt flag in a continued command, and one given to a helper
    typo = TEXT.replace("--new-tokens 8 \\\n", "--new-tokenz 8 \\\n", 1)
    assert [f for _, f, _ in _unknown_flags(typo)] == ["--new-tokenz"]
    typo = TEXT.replace("goal_cell 95 --new-tokens 65", "goal_cell 95 --new-token 65", 1)
    assert [f for _, f, _ in _unknown_flags(typo)] == ["--new-token"]


def _run_stage(cwd: Path, cache: Path, out: Path) -> subprocess.CompletedProcess:
    """``pass167`` under a stand-in ``nvidia-smi`` that names no H200: the stage runs nothing."""
    bin_dir = cwd / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'Stand-in GPU, 1 MiB, 1 MHz'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "GPU_CHECK_TRITON_CACHE": str(cache)}
    return subprocess.run(["bash", str(SCRIPT), "pass167"], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=60)


def test_triton_cache_goes_out_and_comes_back(tmp_path: Path):
    """A stage sends its Triton cache's binaries and metadata to $OUT (not the PTX and IR);
    keep_triton_cache.sh keeps them in .tc/, and the next stage starts with them in its cache."""
    first = tmp_path / "first"
    kernel = first / "cache" / "HASH"
    kernel.mkdir(parents=True)
    (kernel / "k.cubin").write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    (kernel / "__grp__k.json").write_text('{"child_paths": {}}')
    (kernel / "k.ptx").write_text("// ptx")
    (first / "out").mkdir()
    proc = _run_stage(first, first / "cache", first / "out")
    assert proc.returncode == 0 and "not an H200" in proc.stdout, proc.stdout + proc.stderr
    assert [p.name for p in (first / "out").iterdir()] == ["triton_cache.tgz.00"]

    second = tmp_path / "second"
    second.mkdir()
    keep = subprocess.run(["bash", str(REPO / "benchmarks" / "keep_triton_cache.sh"), str(first / "out")],
                          capture_output=True, text=True, cwd=second, timeout=60)
    assert keep.returncode == 0 and (second / ".tc" / "triton_cache.tgz.00").is_file(), keep.stderr
    (second / "out").mkdir()
    proc = _run_stage(second, second / "cache", second / "out")
    assert "Triton cache carried: 1 kernels" in proc.stdout, proc.stdout + proc.stderr
    carried = second / "cache" / "HASH"
    assert (carried / "k.cubin").read_bytes() == (kernel / "k.cubin").read_bytes()
    assert (carried / "__grp__k.json").is_file() and not (carried / "k.ptx").exists()

    nothing = subprocess.run(["bash", str(REPO / "benchmarks" / "keep_triton_cache.sh"), str(tmp_path)],
                             capture_output=True, text=True, cwd=second, timeout=60)
    assert nothing.returncode == 1 and "nothing kept" in nothing.stderr
    assert (second / ".tc" / "triton_cache.tgz.00").is_file()  # the kept cache is untouched
