"""Acceptance: ``laguna-dflash generate`` (``python -m laguna_dflash generate``).

Two real subprocess runs (the console entry point as users call it: JSON output and an error
exit); everything else calls ``laguna_dflash.cli.main(argv)`` in-process, which is what the
console script runs.  Output must agree with the offline API (``LLM.generate``), and user
errors must end with a non-zero exit code and ONE readable ``error: ...`` line on stderr, no
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hf_fixtures as hf
import pytest

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.cli import build_parser, main
from laguna_dflash.train.draft import DraftTrainConfig
from laguna_dflash.train.target import TargetTrainConfig

CONFIG = "xs_mini"
PROMPT_IDS = [1, 2, 3, 17, 42, 99, 200, 311, 5, 8]  # longer than the window of 7


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.make_laguna_checkpoint(tmp_path_factory.mktemp("cli") / CONFIG, CONFIG, seed=9)


@pytest.fixture(scope="module")
def tok_ckpt(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights with a tokenizer (vocab 384) next to them."""
    d = Path(shutil.copytree(ckpt, tmp_path_factory.mktemp("cli-tok") / "ckpt"))
    hf.make_tokenizer(d, 384)
    return d


def _run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """Run ``cli.main`` in-process; returns (exit code, stdout, stderr). argparse exits count."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error_line(code: int, err: str, *needles: str) -> str:
    """Non-zero exit, no traceback, exactly one ``error:`` line, mentioning every needle."""
    assert code != 0
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if re.search(r"(^|: )error: ", ln)]
    assert len(lines) == 1, f"expected one error line, stderr was:\n{err}"
    assert err.strip().splitlines() == lines, f"stderr holds more than the error line:\n{err}"
    for needle in needles:
        assert re.search(needle, lines[0], re.IGNORECASE), f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def _greedy_ids(model: Path, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return (
        LLM(model=str(model)).generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
    )


# --------------------------------------------------------------------------------------------
# Subprocess: the real entry point
# --------------------------------------------------------------------------------------------


def _subprocess(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "laguna_dflash", "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_subprocess_json_output_matches_llm_generate(ckpt: Path):
    """``python -m laguna_dflash generate --prompt-ids ... --json`` prints exactly one JSON object
    (token_ids, text, finish_reason, timings) whose greedy token ids equal ``LLM.generate``'s."""
    proc = _subprocess(
        [
            "--model",
            str(ckpt),
            "--prompt-ids",
            ",".join(map(str, PROMPT_IDS)),
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--json",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"stdout should be one JSON object:\n{proc.stdout}"
    obj = json.loads(lines[0])
    assert {"token_ids", "text", "finish_reason", "timings"} <= set(obj)
    assert obj["token_ids"] == _greedy_ids(ckpt, PROMPT_IDS, 12)
    assert obj["finish_reason"] == "length"
    assert obj["text"] is None  # no tokenizer in this checkpoint
    assert isinstance(obj["timings"], dict) and obj["timings"]
    assert all(isinstance(v, (int, float)) and v >= 0 for v in obj["timings"].values())


def test_subprocess_missing_model_is_one_error_line(tmp_path: Path):
    """A missing model directory: exit code != 0, one ``error:`` line naming the path."""
    missing = tmp_path / "nope"
    proc = _subprocess(["--model", str(missing), "--prompt-ids", "1,2,3"])
    _assert_one_error_line(proc.returncode, proc.stderr, re.escape(str(missing)))
    assert proc.stdout == ""


# --------------------------------------------------------------------------------------------
# In-process: cli.main
# --------------------------------------------------------------------------------------------


def test_main_json_greedy_equals_llm_generate(ckpt: Path, capsys: pytest.CaptureFixture):
    """In-process ``main([... --json])`` returns 0 and prints one JSON object whose token ids are
    ``LLM.generate``'s greedy ids (the CLI default is greedy); timings has load/prefill/decode."""
    code, out, err = _run_main(
        [
            "generate",
            "--model",
            str(ckpt),
            "--prompt-ids",
            " 1, 2,3,17,42,99,200,311,5,8",
            "--max-new-tokens",
            "20",
            "--ignore-eos",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    obj = json.loads(out)
    assert obj["token_ids"] == _greedy_ids(ckpt, PROMPT_IDS, 20)
    assert obj["finish_reason"] == "length"
    for key in ("load_s", "prefill_s", "decode_s"):
        assert key in obj["timings"]


def test_main_respects_eos_without_ignore_eos(ckpt: Path, tmp_path: Path, capsys):
    """Without ``--ignore-eos`` the config's EOS stops generation (finish_reason "stop")."""
    ref = _greedy_ids(ckpt, PROMPT_IDS, 20)
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    d = Path(shutil.copytree(ckpt, tmp_path / "eos"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = ref[k]
    (d / "config.json").write_text(json.dumps(cfg))
    code, out, err = _run_main(
        [
            "generate",
            "--model",
            str(d),
            "--prompt-ids",
            ",".join(map(str, PROMPT_IDS)),
            "--max-new-tokens",
            "20",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    obj = json.loads(out)
    assert obj["token_ids"] == ref[: k + 1] and obj["finish_reason"] == "stop"


def test_main_text_prompt_with_tokenizer(tok_ckpt: Path, capsys: pytest.CaptureFixture):
    """``--prompt TEXT`` (and the positional TEXT) uses the checkpoint's tokenizer: JSON text and
    ids equal ``LLM.generate(prompts=[TEXT])``; plain mode prints the text on stdout and a
    stats line on stderr."""
    text = "def main():\n    print('hello"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(model=str(tok_ckpt)).generate([text], params)[0]
    assert ref.text is not None
    base = ["generate", "--model", str(tok_ckpt), "--max-new-tokens", "8", "--ignore-eos"]
    for argv in (base + ["--prompt", text, "--json"], base + [text, "--json"]):
        code, out, err = _run_main(argv, capsys)
        assert code == 0, err
        obj = json.loads(out)
        assert obj["token_ids"] == ref.token_ids and obj["text"] == ref.text
    code, out, err = _run_main(base + ["--prompt", text], capsys)
    assert code == 0, err
    assert out == ref.text + "\n"
    assert "8 tokens" in err and "Traceback" not in err


def test_main_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture):
    """A model directory that does not exist: exit != 0, one error line naming it."""
    missing = tmp_path / "missing-model"
    code, _, err = _run_main(["generate", "--model", str(missing), "--prompt-ids", "1,2"], capsys)
    _assert_one_error_line(code, err, re.escape(str(missing)))


@pytest.mark.parametrize("bad", ["1,x,3", "1;2;3", "one"])
def test_main_bad_prompt_ids(ckpt: Path, capsys: pytest.CaptureFixture, bad: str):
    """``--prompt-ids`` that are not comma-separated integers: exit != 0, one error line that
    names ``--prompt-ids``."""
    code, _, err = _run_main(["generate", "--model", str(ckpt), "--prompt-ids", bad], capsys)
    _assert_one_error_line(code, err, "prompt-ids")


def test_main_prompt_ids_outside_vocab(ckpt: Path, capsys: pytest.CaptureFixture):
    """Ids outside the vocabulary are a user error reported on one line, not a traceback."""
    code, _, err = _run_main(["generate", "--model", str(ckpt), "--prompt-ids", "1,384"], capsys)
    _assert_one_error_line(code, err, "vocab")


def test_main_text_prompt_without_tokenizer(ckpt: Path, capsys: pytest.CaptureFixture):
    """A text prompt for a checkpoint without tokenizer files: one error line about the tokenizer."""
    code, _, err = _run_main(["generate", "--model", str(ckpt), "--prompt", "hello"], capsys)
    _assert_one_error_line(code, err, "tokenizer")


def test_main_num_speculative_tokens_without_draft(ckpt: Path, capsys: pytest.CaptureFixture):
    """``--num-speculative-tokens`` without ``--draft``: one error line naming both options."""
    code, _, err = _run_main(
        [
            "generate",
            "--model",
            str(ckpt),
            "--prompt-ids",
            "1,2,3",
            "--num-speculative-tokens",
            "4",
        ],
        capsys,
    )
    _assert_one_error_line(code, err, "num-speculative-tokens", "draft")


def test_main_draft_tensor_parallel_size_without_draft(ckpt: Path, capsys: pytest.CaptureFixture):
    """``--draft-tensor-parallel-size`` without a drafter: one error line naming both options."""
    code, _, err = _run_main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2,3",
                              "--draft-tensor-parallel-size", "1"], capsys)
    _assert_one_error_line(code, err, "draft-tensor-parallel-size", "draft")


def test_main_needs_exactly_one_prompt(ckpt: Path, capsys: pytest.CaptureFixture):
    """Neither or both of a text prompt and ``--prompt-ids``: one error line, exit != 0."""
    code, _, err = _run_main(["generate", "--model", str(ckpt)], capsys)
    _assert_one_error_line(code, err, "prompt")
    code, _, err = _run_main(
        ["generate", "--model", str(ckpt), "--prompt", "hi", "--prompt-ids", "1"], capsys
    )
    _assert_one_error_line(code, err, "prompt")


def test_main_prompt_given_twice_is_an_error(ckpt: Path, capsys: pytest.CaptureFixture):
    """TEXT and ``--prompt`` together: TEXT used to be dropped silently."""
    code, _, err = _run_main(["generate", "--model", str(ckpt), "one", "--prompt", "other"], capsys)
    _assert_one_error_line(code, err, "TEXT or as --prompt, not both")


def test_main_compare_without_drafter_is_an_error(ckpt: Path, capsys: pytest.CaptureFixture):
    """``--compare`` (run target-only too and compare) with no drafter, or with ``--no-spec``,
    used to print a plain run's stats as if nothing had been asked."""
    code, _, err = _run_main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2,3",
                              "--compare"], capsys)
    _assert_one_error_line(code, err, "--compare needs --draft DIR")
    code, _, err = _run_main(["generate", "--model", str(ckpt), "--draft", str(ckpt), "--no-spec",
                              "--prompt-ids", "1,2,3", "--compare"], capsys)
    _assert_one_error_line(code, err, "--compare needs --draft DIR")


def test_version_flag(capsys: pytest.CaptureFixture):
    from laguna_dflash import __version__

    code, out, _ = _run_main(["--version"], capsys)
    assert code == 0 and out.strip() == f"laguna-dflash {__version__}"


@pytest.mark.parametrize("command", [["train-target", "--out-dir", "o"],
                                     ["train-draft", "--target", "t", "--out-dir", "o"]])
def test_training_device_typo_names_the_flag(command: list[str], capsys, tmp_path: Path):
    """``--device cudax`` used to end with torch's list of every device type it knows."""
    argv = [a if a not in ("o", "t") else str(tmp_path / a) for a in command]
    code, _, err = _run_main([*argv, "--device", "cudax"], capsys)
    _assert_one_error_line(code, err, "--device 'cudax' is not supported")


@pytest.mark.parametrize("command", [["generate", "--model", "m"], ["serve", "--model", "m"],
                                     ["train-draft", "--target", "t", "--out-dir", "o"]],
                         ids=["generate", "serve", "train-draft"])
def test_log_level_is_checked_and_takes_any_case(command: list[str], capsys):
    """``--log-level bogus`` is refused naming the choices (it used to mean WARNING silently)."""
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args([*command, "--log-level", "bogus"])
    assert info.value.code == 2 and "WARNING" in capsys.readouterr().err
    assert parser.parse_args([*command, "--log-level", "debug"]).log_level == "DEBUG"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    """The CLI's subcommand parsers by name (argparse has no public way to reach them)."""
    return build_parser()._subparsers._group_actions[0].choices


def test_every_flag_has_help():
    """``--help`` explains every flag of every command, not only its name and default."""
    for name, sub in _subcommands().items():
        for action in sub._actions:
            if action.option_strings and action.help is not argparse.SUPPRESS:
                text = action.help or ""
                assert len(text.split()) >= 2 and not text.startswith("default"), (name, action.dest)


@pytest.mark.parametrize("command", ["train-target", "train-draft"])
def test_training_flags_say_what_they_do(command: str):
    """Every training flag's ``--help`` line says what it sets, then its default (or that it is
    required): the configs' fields used to show only ``default: X``."""
    cls = TargetTrainConfig if command == "train-target" else DraftTrainConfig
    actions = {a.dest: a for a in _subcommands()[command]._actions}
    for f in dataclasses.fields(cls):
        text = actions[f.name].help
        words = text.split(" (")[0]
        assert len(words.split()) >= 2 and not words.startswith("default"), f"{f.name}: {text!r}"
        if f.default is dataclasses.MISSING:
            assert text.endswith("(required)"), f"{f.name}: {text!r}"
        else:
            assert "default: " in text, f"{f.name}: {text!r}"
            if f.default is not None:
                assert text.endswith(f"(default: {f.default})"), f"{f.name}: {text!r}"


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_max_tokens_is_max_new_tokens(command: str):
    """``--max-tokens`` (the OpenAI / vLLM name) sets the same value as ``--max-new-tokens``."""
    parser = build_parser()
    assert parser.parse_args([command, "--max-tokens", "7"]).max_new_tokens == 7
    assert parser.parse_args([command, "--max-new-tokens", "9"]).max_new_tokens == 9
    assert parser.parse_args([command]).max_new_tokens == (64 if command == "generate" else 128)


def test_main_broken_checkpoint_is_one_error_line(ckpt: Path, tmp_path: Path, capsys):
    """A checkpoint that fails to load (invalid config.json) is reported on one error line."""
    d = Path(shutil.copytree(ckpt, tmp_path / "broken"))
    (d / "config.json").write_text("{not json")
    code, _, err = _run_main(["generate", "--model", str(d), "--prompt-ids", "1,2"], capsys)
    _assert_one_error_line(code, err, "JSON")


def test_main_penalties(ckpt: Path, capsys: pytest.CaptureFixture):
    """``--repetition-penalty`` reaches the sampler (the output changes); a value out of range
    is one error line naming it."""
    base = ["generate", "--model", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "12",
            "--ignore-eos", "--json", "--no-compare"]
    code, plain, _ = _run_main(base, capsys)
    assert code == 0
    code, penalised, _ = _run_main(base + ["--repetition-penalty", "5", "--presence-penalty", "2"], capsys)
    assert code == 0
    assert json.loads(penalised)["token_ids"] != json.loads(plain)["token_ids"]
    code, _, err = _run_main(base + ["--repetition-penalty", "0"], capsys)
    _assert_one_error_line(code, err, "repetition_penalty")


def test_main_corrupt_weights_is_one_error_line(ckpt: Path, tmp_path: Path, capsys):
    """A truncated model.safetensors (an interrupted download) is one error line naming it."""
    d = Path(shutil.copytree(ckpt, tmp_path / "truncated"))
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    code, _, err = _run_main(["generate", "--model", str(d), "--prompt-ids", "1,2"], capsys)
    _assert_one_error_line(code, err, "model.safetensors")


# --------------------------------------------------------------------------------------------
# bench: bad prompt files and flags are one error line, before any model is loaded
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from laguna_dflash.models.random_init import write_random_pair

    return write_random_pair(tmp_path_factory.mktemp("bench-pair"))


@pytest.mark.parametrize("content,needles", [
    ("[]", ("no prompts",)),
    ('{"text": "a"}\n', (r":1\b", "prompt")),
    ("[1, 2]", (r"\[0\]|:1\b", "prompt")),
    ('[["a"]]', (r"\[0\]|:1\b", "prompt")),
    ('["ok", {"prompt": 5}]', (r"\[1\]|:2\b", "prompt")),
])
def test_bench_bad_prompt_file(bench_pair, tmp_path: Path, capsys, content: str, needles):
    target, draft = bench_pair
    f = tmp_path / "prompts.json"
    f.write_text(content)
    code, _, err = _run_main(["bench", "--model", str(target), "--draft", str(draft), "--prompts", str(f),
                              "--max-new-tokens", "4"], capsys)
    _assert_one_error_line(code, err, re.escape(str(f)), *needles)


@pytest.mark.parametrize("flags,needle", [
    (["--prompts", "/nonexistent/prompts.json"], "--prompts /nonexistent/prompts.json"),
    (["--batch-size", "0"], "--batch-size"), (["--batch-size", "-2"], "--batch-size"),
    (["--num-prompts", "0"], "--num-prompts"), (["--num-prompts", "-3"], "--num-prompts"),
    (["--max-new-tokens", "1"], "--max-new-tokens"), (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bench_bad_flags(bench_pair, capsys, flags, needle):
    target, draft = bench_pair
    code, _, err = _run_main(["bench", "--model", str(target), "--draft", str(draft), "--num-prompts", "2",
                              "--max-new-tokens", "4", *flags], capsys)
    _assert_one_error_line(code, err, needle)


def test_main_structured_outputs(capsys: pytest.CaptureFixture):
    """``--structured-outputs JSON`` (the demo pair, its tokenizer): a choice and a grammar give
    matching text ending with "stop", DFlash's tokens those of LLM.generate with the constraint;
    a bad value is one error line naming the flag."""
    from laguna_dflash.demo import demo_pair

    target, draft = demo_pair()
    cases = [({"choice": ["yes", "no", "maybe"]}, r"yes|no|maybe"),
             ({"grammar": 'root ::= "(" root ")" | "x"'}, r"\(*x\)*")]
    for constraint, pattern in cases:
        code, out, err = _run_main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "24", "--json",
                                    "--no-compare", "--structured-outputs", json.dumps(constraint)], capsys)
        assert code == 0, err
        obj = json.loads(out)
        assert obj["finish_reason"] == "stop" and re.fullmatch(pattern, obj["text"]), obj["text"]
        ref = LLM(str(target)).generate(["def f(x):"], SamplingParams(
            temperature=0, max_tokens=24, structured_outputs=constraint), use_tqdm=False)[0]
        assert obj["token_ids"] == ref.token_ids
    for bad, needle in (("[1]", "--structured-outputs: must be a JSON object"),
                        ("{nope", "--structured-outputs: must be a JSON object"),
                        ('{"regex": "a", "choice": ["b"]}', "--structured-outputs: StructuredOutputsParams takes "
                                                          "exactly one")):
        code, out, err = _run_main(["generate", "--prompt", "x", "--no-compare", "--structured-outputs", bad],
                                   capsys)
        assert code != 0 and needle in err and "Traceback" not in err, err
