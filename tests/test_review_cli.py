"""CLI review: a bad flag value is one ``error:`` line that names the FLAG the user typed (not
only the config field behind it), and checks that can fail before loading or running do.

Everything calls ``laguna_dflash.cli.main`` in-process (``tests/test_cli.py`` has the
subprocess cases). Most cases fail before any model is loaded; the few that load use the
embedded demo pair (28.7 MB) and decode two tokens.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
from test_cli import _assert_one_error_line, _run_main

import laguna_dflash.bench
import laguna_dflash.server.launcher
from laguna_dflash.bench import BenchResult
from laguna_dflash.config import SpeculativeConfig
from laguna_dflash.demo import demo_pair


@pytest.fixture
def empty_dir(tmp_path: Path) -> Path:
    """An existing directory: the CLI's path checks pass and the config checks run (they come
    before anything reads it)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list:
    """``serve`` never starts a server here: the launcher records its config instead."""
    calls: list = []
    monkeypatch.setattr(laguna_dflash.server.launcher, "serve", lambda config: calls.append(config) or 0)
    return calls


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> list:
    """``bench`` without decoding: ``run_bench`` records its call and returns fixed numbers."""
    calls: list = []
    result = BenchResult(num_prompts=2, num_tokens=10, target_only_tokens_per_s=50.0,
                         spec_tokens_per_s=75.0, speedup=1.5, mean_acceptance_length=2.5,
                         per_position_acceptance_rate=[0.75, 0.5], outputs_identical=True,
                         num_speculative_tokens=2)

    def run_bench(*args: object, **kwargs: object) -> BenchResult:
        calls.append((args, kwargs))
        return result

    monkeypatch.setattr(laguna_dflash.bench, "run_bench", run_bench)
    return calls


# --------------------------------------------------------------------------------------------
# Engine / speculative flags: the error names the flag (EngineConfig / SpeculativeConfig)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags,needle", [
    (["--block-size", "0"], "--block-size"),
    (["--max-model-len", "1"], "--max-model-len"),
    (["--max-logprobs", "-2"], "--max-logprobs"),
    (["--dtype", "int8"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--attention-backend", "flash"], "--attention-backend"),
])
def test_generate_engine_flag_error_names_the_flag(empty_dir: Path, capsys, flags, needle):
    code, out, err = _run_main(["generate", "--model", str(empty_dir), "--prompt-ids", "1,2,3",
                                *flags], capsys)
    _assert_one_error_line(code, err, re.escape(needle))
    assert out == ""


@pytest.mark.parametrize("flags,needle", [
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--simulate-acceptance-length", "0.5"], "--simulate-acceptance-length"),
    (["--simulate-acceptance-length", "nan"], "--simulate-acceptance-length"),
    (["--simulate-acceptance-length", "inf"], "--simulate-acceptance-length"),
])
def test_generate_speculative_flag_error_names_the_flag(empty_dir: Path, capsys, flags, needle):
    """NaN and infinity used to pass (``nan < 1`` is False) and fail at the first engine step
    with "cannot convert float NaN to integer"; now they are refused up front."""
    code, _, err = _run_main(["generate", "--model", str(empty_dir), "--draft", str(empty_dir),
                              "--prompt-ids", "1,2,3", *flags], capsys)
    _assert_one_error_line(code, err, re.escape(needle))


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.5])
def test_speculative_config_refuses_non_finite_simulated_acceptance(value: float):
    with pytest.raises(ValueError, match="simulate_acceptance_length must be a finite number >= 1"):
        SpeculativeConfig(draft="d", simulate_acceptance_length=value)
    assert SpeculativeConfig(draft="d", simulate_acceptance_length=1.0).simulate_acceptance_length == 1.0


def test_serve_max_num_seqs_error_names_the_flag(empty_dir: Path, capsys, no_launch):
    code, _, err = _run_main(["serve", "--model", str(empty_dir), "--max-num-seqs", "0"], capsys)
    _assert_one_error_line(code, err, "--max-num-seqs")
    assert no_launch == []


# --------------------------------------------------------------------------------------------
# generate's sampling flags: --max-new-tokens 0 used to say "SamplingParams.max_tokens"
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag,value", [
    ("--max-new-tokens", "0"), ("--max-new-tokens", "-1"), ("--temperature", "-1"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-k", "-5"), ("--presence-penalty", "3"),
    ("--frequency-penalty", "-2.5"), ("--repetition-penalty", "0"),
])
def test_generate_sampling_flag_error_names_the_flag(empty_dir: Path, capsys, flag, value):
    code, _, err = _run_main(["generate", "--model", str(empty_dir), "--prompt-ids", "1,2,3",
                              flag, value], capsys)
    line = _assert_one_error_line(code, err, re.escape(f"{flag} {value}"))
    assert "must be" in line  # the dataclass's reason follows the flag


# --------------------------------------------------------------------------------------------
# Checkpoint directories: the flag that named a missing one
# --------------------------------------------------------------------------------------------


def test_generate_missing_draft_dir_names_draft(tmp_path: Path, capsys):
    """The loader says "model path ... is not a directory" for either checkpoint; a typo in
    ``--draft`` must not read as a problem with ``--model``."""
    target, _ = demo_pair()
    missing = tmp_path / "no-such-draft"
    code, _, err = _run_main(["generate", "--model", target, "--draft", str(missing),
                              "--prompt-ids", "1,2,3"], capsys)
    line = _assert_one_error_line(code, err, re.escape(f"--draft {missing}"), "drafter")
    assert "model path" not in line


def test_generate_no_spec_ignores_a_missing_draft_dir(tmp_path: Path, capsys):
    """``--no-spec`` ignores ``--draft`` (README), so a missing one is no error."""
    target, _ = demo_pair()
    code, out, err = _run_main(["generate", "--model", target, "--draft", str(tmp_path / "nope"),
                                "--no-spec", "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                                "--json"], capsys)
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 2


@pytest.mark.parametrize("flag", ["--draft", "--speculative-draft-model-path"])
def test_serve_missing_draft_dir_names_its_flag(tmp_path: Path, capsys, no_launch, flag):
    target, _ = demo_pair()
    missing = tmp_path / "no-such-draft"
    code, _, err = _run_main(["serve", "--model", target, flag, str(missing)], capsys)
    _assert_one_error_line(code, err, re.escape(f"{flag} {missing}"))
    assert no_launch == []


# --------------------------------------------------------------------------------------------
# serve --tokenizer: a directory without a tokenizer used to start a server that could not
# read a text prompt (one warning in the log)
# --------------------------------------------------------------------------------------------


def test_serve_tokenizer_without_tokenizer_files_is_an_error(empty_dir: Path, tmp_path: Path,
                                                             capsys, no_launch):
    target, _ = demo_pair()
    for bad in (empty_dir, tmp_path / "missing"):
        code, _, err = _run_main(["serve", "--model", target, "--tokenizer", str(bad)], capsys)
        _assert_one_error_line(code, err, re.escape(f"--tokenizer {bad}"), "tokenizer.json")
    assert no_launch == []
    # the demo target holds a tokenizer: accepted and passed on
    code, _, err = _run_main(["serve", "--model", target, "--tokenizer", target], capsys)
    assert code == 0, err
    assert [c.tokenizer for c in no_launch] == [target]


# --------------------------------------------------------------------------------------------
# bench --plot: checked before the benchmark, and the numbers printed before the plot is saved
# --------------------------------------------------------------------------------------------


def test_bench_plot_into_missing_directory_fails_before_running(tmp_path: Path, capsys, fake_bench):
    """It used to run the whole benchmark, then fail with a bare ``[Errno 2] No such file or
    directory`` and print no numbers."""
    png = tmp_path / "missing" / "acc.png"
    code, out, err = _run_main(["bench", "--num-prompts", "1", "--max-new-tokens", "4",
                                "--plot", str(png)], capsys)
    _assert_one_error_line(code, err, re.escape(f"--plot {png}"), "does not exist")
    assert fake_bench == [] and out == ""


def test_bench_plot_without_matplotlib_fails_before_running(tmp_path: Path, capsys, fake_bench,
                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = _run_main(["bench", "--num-prompts", "1", "--max-new-tokens", "4",
                                "--plot", str(tmp_path / "acc.png")], capsys)
    _assert_one_error_line(code, err, "--plot", "matplotlib")
    assert fake_bench == [] and out == ""


def test_bench_prints_its_numbers_even_if_the_plot_fails(tmp_path: Path, capsys, fake_bench,
                                                        monkeypatch: pytest.MonkeyPatch):
    def broken_plot(result: BenchResult, path: str) -> None:
        raise OSError(f"disk full writing {path}")

    monkeypatch.setattr(laguna_dflash.bench, "save_acceptance_plot", broken_plot)
    code, out, err = _run_main(["bench", "--num-prompts", "1", "--max-new-tokens", "4", "--json",
                                "--plot", str(tmp_path / "acc.png")], capsys)
    _assert_one_error_line(code, err, "disk full")
    assert len(fake_bench) == 1
    assert json.loads(out)["speedup"] == 1.5


def test_bench_plot_is_written(tmp_path: Path, capsys, fake_bench):
    png = tmp_path / "acc.png"
    code, out, err = _run_main(["bench", "--num-prompts", "1", "--max-new-tokens", "4",
                                "--plot", str(png)], capsys)
    assert code == 0, err
    assert "speedup 1.50x" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# Speculative flags without a drafter, and --trace without --json: errors, not silently ignored
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--adaptive-k"], ["--simulate-acceptance-length", "3"],
                                   ["--num-speculative-tokens", "3"]])
@pytest.mark.parametrize("no_spec", [False, True])
def test_generate_speculative_flags_without_a_drafter_are_an_error(empty_dir: Path, capsys, flags, no_spec):
    """``--adaptive-k`` and ``--simulate-acceptance-length`` were dropped without a word when no
    drafter ran (as ``--num-speculative-tokens`` already was not)."""
    extra = ["--draft", str(empty_dir), "--no-spec"] if no_spec else []
    code, out, err = _run_main(["generate", "--model", str(empty_dir), "--prompt-ids", "1,2,3",
                                *extra, *flags], capsys)
    _assert_one_error_line(code, err, re.escape(flags[0]), "needs --draft")
    assert out == ""


@pytest.mark.parametrize("flags", [["--adaptive-k"], ["--simulate-acceptance-length", "3"]])
def test_serve_speculative_flags_without_a_drafter_are_an_error(empty_dir: Path, capsys, no_launch, flags):
    code, _, err = _run_main(["serve", "--model", str(empty_dir), *flags], capsys)
    _assert_one_error_line(code, err, re.escape(flags[0]), "needs a drafter")
    assert no_launch == []


@pytest.mark.parametrize("option", [{"adaptive_k": True}, {"simulate_acceptance_length": 3.0},
                                    {"num_speculative_tokens": 3}])
def test_llm_speculative_options_without_a_drafter_are_an_error(empty_dir: Path, option):
    from laguna_dflash import LLM

    with pytest.raises(ValueError, match=f"{next(iter(option))} was given without draft="):
        LLM(str(empty_dir), **option)


def test_generate_trace_without_json_is_an_error(empty_dir: Path, capsys):
    code, out, err = _run_main(["generate", "--model", str(empty_dir), "--draft", str(empty_dir),
                                "--prompt-ids", "1,2,3", "--trace"], capsys)
    _assert_one_error_line(code, err, "--trace", "--json")
    assert out == ""


# --------------------------------------------------------------------------------------------
# generate / bench take serve's vLLM and SGLang spellings of the drafter too
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", [
    lambda d: ["--speculative-config", json.dumps({"method": "dflash", "model": d, "num_speculative_tokens": 3})],
    lambda d: ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", d,
               "--speculative-num-draft-tokens", "4"],
], ids=["vllm", "sglang"])
def test_generate_takes_serves_speculative_spellings(capsys, spelling):
    """``generate --speculative-config ...`` (vLLM's) and SGLang's flags give the run that
    ``--draft DIR --num-speculative-tokens 3`` gives: the same tokens and acceptance (before,
    argparse refused them: only serve knew them)."""
    target, draft = demo_pair()
    common = ["generate", "--model", str(target), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12",
              "--json", "--no-compare"]
    outs = []
    for flags in (["--draft", str(draft), "--num-speculative-tokens", "3"], spelling(str(draft))):
        code, out, err = _run_main([*common, *flags], capsys)
        assert code == 0, err
        outs.append(json.loads(out))
    assert outs[1]["token_ids"] == outs[0]["token_ids"]
    assert outs[1]["mean_acceptance_length"] == outs[0]["mean_acceptance_length"]


def test_generate_conflicting_speculative_spellings_name_both_flags(tmp_path: Path, capsys):
    target, draft = demo_pair()
    code, _, err = _run_main(["generate", "--model", str(target), "--prompt-ids", "1,2",
                              "--draft", str(draft), "--speculative-config",
                              json.dumps({"model": str(tmp_path)})], capsys)
    _assert_one_error_line(code, err, "--draft", "--speculative-config")


def test_bench_missing_sglang_draft_dir_names_its_flag(tmp_path: Path, capsys, fake_bench):
    target, _ = demo_pair()
    code, _, err = _run_main(["bench", "--model", str(target), "--speculative-algorithm", "DFLASH",
                              "--speculative-draft-model-path", str(tmp_path / "nope")], capsys)
    _assert_one_error_line(code, err, "--speculative-draft-model-path")
    assert fake_bench == []
