"""``laguna-dflash token-map`` (laguna_dflash/token_map.py): a corpus counted with the target's
tokenizer becomes a token map of its most frequent ids (plus the end-of-sequence ids) that the
engine loads as ``speculative_token_map`` without changing the target's greedy output.

Uses the embedded demo pair (its target has a real tokenizer, vocab 4096) and tmp_path corpora.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_cli import _run_main

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.demo import demo_pair, heldout_prompts
from laguna_dflash.llm import load_tokenizer
from laguna_dflash.models.draft_vocab import load_token_map
from laguna_dflash.token_map import (
    CorpusStats,
    build_token_map,
    count_tokens,
    iter_texts,
    record_text,
    token_coverage,
)
from laguna_dflash.train.data import stdlib_files

TARGET, DRAFT = demo_pair()
VOCAB = 4096
EOS = 2  # the demo target's config.json and generation_config.json eos_token_id

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i, i * i)\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TARGET)


def _direct_counts(tokenizer, texts: list[str]) -> Counter:
    counts: Counter = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    return counts


def _expected_map(counts: Counter, num_tokens: int, always: tuple[int, ...] = (EOS,)) -> list[int]:
    """The top ``num_tokens`` ids by count (ties: smaller id first) with ``always`` forced in, in
    frequency order: written out independently of ``most_frequent_tokens``."""
    ranked = sorted(range(VOCAB), key=lambda t: (-counts[t], t))
    rest = [t for t in ranked if t not in always][: num_tokens - len(always)]
    return sorted([*rest, *always], key=lambda t: (-counts[t], t))


def _write_corpus(root: Path) -> Path:
    """A directory of three .py files, a .txt file and a nested .md file."""
    (root / "pkg" / "sub").mkdir(parents=True)
    for i, text in enumerate(CODE):
        (root / "pkg" / f"m{i}.py").write_text(text)
    (root / "pkg" / "notes.txt").write_text("plain notes, not python\n")
    (root / "pkg" / "sub" / "readme.md").write_text("# Title\n\nSome words.\n")
    return root / "pkg"


def _one_error_line(result: tuple[int, str, str], *needles: str) -> str:
    """``_run_main``'s result: a non-zero exit, nothing on stdout, one ``error:`` line on stderr
    (no traceback) holding every needle -> the line."""
    code, out, err = result
    assert code != 0 and not out
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


# --------------------------------------------------------------------------------------------
# Counting and the map
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_counts_and_top_n_with_eos(tmp_path: Path, tokenizer, suffix: str):
    """The corpus's counts equal a direct count with the tokenizer; the map is the top-N by count
    (ties by id) with EOS forced in, loadable with ``load_token_map``."""
    corpus = _write_corpus(tmp_path)
    texts = [(corpus / f"m{i}.py").read_text() for i in range(3)]
    counts = count_tokens(iter_texts([corpus], glob="*.py"), tokenizer, VOCAB)
    direct = _direct_counts(tokenizer, texts)
    assert counts.shape == (VOCAB,) and counts.dtype == torch.int64
    assert {t: int(c) for t, c in enumerate(counts.tolist()) if c} == dict(direct)

    out = tmp_path / "maps" / f"map{suffix}"  # the parent is created
    summary = build_token_map(TARGET, [corpus], 12, out, glob="*.py")
    ids = load_token_map(out, VOCAB)
    assert ids.tolist() == _expected_map(direct, 12)
    assert EOS in ids.tolist() and direct[EOS] == 0  # the corpus never holds EOS: forced
    assert summary.num_files == 3 and summary.num_skipped_files == 0
    assert summary.num_corpus_tokens == sum(direct.values())
    assert summary.num_distinct_tokens == len(direct)
    assert summary.num_tokens == 12 and summary.vocab_size == VOCAB and summary.output == str(out)
    covered = sum(direct[t] for t in ids.tolist())
    assert summary.coverage == pytest.approx(covered / sum(direct.values()))
    if suffix == ".json":
        assert json.loads(out.read_text()) == ids.tolist()
    else:
        raw = torch.load(out, weights_only=True)
        assert isinstance(raw, torch.Tensor) and raw.dtype == torch.int64


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_a_map_written_into_the_corpus_is_not_counted_again(tmp_path: Path, suffix: str):
    """``--output`` under a ``--data`` directory: a second run reads the same corpus (the map of
    the first is neither counted as text nor parsed as records) and writes the same map."""
    corpus = _write_corpus(tmp_path)
    out = corpus / f"map{suffix}"
    first = build_token_map(TARGET, [corpus], 40, out)
    ids = load_token_map(out, VOCAB).tolist()
    second = build_token_map(TARGET, [corpus], 40, out)
    assert second == first and load_token_map(out, VOCAB).tolist() == ids


def test_generation_config_eos_ids_kept(tmp_path: Path):
    """generation_config.json's end-of-sequence ids are kept beside config.json's."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(TARGET) / name, model / name)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3000, 3001]}))
    corpus = tmp_path / "c.txt"
    corpus.write_text(CODE[0] * 3)
    ids = load_token_map(build_token_map(model, [corpus], 5, tmp_path / "m.pt").output, VOCAB).tolist()
    assert {2, 3000, 3001} <= set(ids) and len(ids) == 5


def test_coverage_hand_checked():
    """A character tokenizer: 'aaab' + 'ac' is a:4 b:1 c:1; the map [a] covers 4 of 6 tokens,
    [a, b] 5 of 6."""

    class Chars:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(ch) - ord("a") for ch in text]

    counts = count_tokens(["aaab", "ac"], Chars(), 8)
    assert counts.tolist() == [4, 1, 1, 0, 0, 0, 0, 0]
    assert token_coverage(counts, torch.tensor([0])) == pytest.approx(4 / 6)
    assert token_coverage(counts, torch.tensor([0, 1])) == pytest.approx(5 / 6)
    assert token_coverage(counts, torch.tensor([3])) == 0.0
    assert token_coverage(torch.zeros(8, dtype=torch.int64), torch.tensor([0])) == 0.0


def test_token_id_outside_vocab_is_an_error():
    class Big:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1, 9]

    with pytest.raises(ValueError, match=r"--model.*token id 9.*vocab_size 8.*does not match"):
        count_tokens(["x"], Big(), 8)


# --------------------------------------------------------------------------------------------
# Reading the corpus
# --------------------------------------------------------------------------------------------


def test_directory_and_glob(tmp_path: Path):
    """A directory is every file under it (recursive, sorted) matching --glob."""
    corpus = _write_corpus(tmp_path)
    stats = CorpusStats()
    assert list(iter_texts([corpus], glob="*.py", stats=stats)) == CODE
    assert stats.num_files == 3
    everything = list(iter_texts([corpus]))  # default glob "*": nested files too, in sorted order
    assert everything == [*CODE, "plain notes, not python\n", "# Title\n\nSome words.\n"]
    assert list(iter_texts([corpus], glob="*.md")) == ["# Title\n\nSome words.\n"]
    # files and directories mixed, in the order given; the glob filters directories only
    assert list(iter_texts([corpus / "notes.txt", corpus], glob="m1.py")) == [
        "plain notes, not python\n", CODE[1]]


def test_json_record_shapes(tmp_path: Path):
    """jsonl/json records: a string, "text", "prompt"+"completion", "messages"."""
    records = [
        "a plain string",
        {"text": "the text", "prompt": "ignored: text comes first"},
        {"prompt": "Q: 1+1?", "completion": " A: 2"},
        {"prompt": "only a prompt"},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": []},
                      {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]},
    ]
    expected = ["a plain string", "the text", "Q: 1+1? A: 2", "only a prompt", "be brief\nhi\nhello"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")  # a blank line: skipped
    as_list = tmp_path / "d.json"
    as_list.write_text(json.dumps(records))
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"text": "a single record"}))
    assert list(iter_texts([jsonl])) == expected
    assert list(iter_texts([as_list])) == expected
    assert list(iter_texts([one])) == ["a single record"]


def test_bad_records_name_the_file_and_line(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"conversations": []}\n')
    with pytest.raises(ValueError, match=r"--data .*bad.jsonl:2.*\"text\""):
        list(iter_texts([bad]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"--data .*broken.jsonl:2: not valid JSON"):
        list(iter_texts([broken]))
    with pytest.raises(ValueError, match=r"\"text\" must be a string"):
        record_text({"text": 3}, "x")


def test_undecodable_file_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              caplog: pytest.LogCaptureFixture):
    (tmp_path / "a.txt").write_text(CODE[0])
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28")
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "\xff"}\n')
    stats = CorpusStats()
    assert list(iter_texts([tmp_path], stats=stats)) == [CODE[0]]
    assert (stats.num_files, stats.num_skipped_files) == (1, 2)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "b.bin" in warned and "c.jsonl" in warned and "not UTF-8" in warned
    code, out, err = _run_main(["token-map", "--model", TARGET, "--data", str(tmp_path),
                                "--num-tokens", "8", "--output", str(tmp_path / "m.json"), "--json"],
                               capsys)
    assert code == 0, err
    obj = json.loads(out)
    assert (obj["num_files"], obj["num_skipped_files"]) == (1, 2)


def test_max_bytes_cuts_the_corpus(tmp_path: Path, tokenizer):
    for i, text in enumerate(CODE):
        (tmp_path / f"m{i}.py").write_text(text)
    limit = len(CODE[0]) + 5
    stats = CorpusStats()
    texts = list(iter_texts([tmp_path], max_bytes=limit, stats=stats))
    assert texts == [CODE[0], CODE[1][:5]]
    assert stats.num_chars == limit and stats.num_files == 2  # the third file is never read
    summary = build_token_map(TARGET, [tmp_path], 8, tmp_path / "m.pt", max_bytes=limit)
    assert summary.num_corpus_tokens == sum(_direct_counts(tokenizer, texts).values())
    with pytest.raises(ValueError, match="--max-bytes"):
        list(iter_texts([tmp_path], max_bytes=0))


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------


def test_cli_end_to_end(tmp_path: Path, tokenizer, capsys: pytest.CaptureFixture):
    corpus = _write_corpus(tmp_path)
    direct = _direct_counts(tokenizer, CODE)
    out = tmp_path / "map.pt"
    code, stdout, err = _run_main(["token-map", "--model", TARGET, "--data", str(corpus),
                                   "--glob", "*.py", "--num-tokens", "16", "--output", str(out)], capsys)
    assert code == 0, err
    total = sum(direct.values())
    ids = load_token_map(out, VOCAB).tolist()
    assert ids == _expected_map(direct, 16)
    pct = 100 * sum(direct[t] for t in ids) / total
    assert f"16 of {VOCAB} tokens cover {pct:.1f}% of the {total} tokens counted" in stdout
    assert re.search(r"read 3 files: .* tokens, \d+ distinct", stdout)
    assert str(out) in stdout

    out_json = tmp_path / "map.json"
    code, stdout, err = _run_main(["token-map", "--model", TARGET, "--data", str(corpus), "--glob", "*.py",
                                   "--num-tokens", "16", "--output", str(out_json), "--json"], capsys)
    assert code == 0, err
    obj = json.loads(stdout)  # one JSON object, nothing else
    assert obj == {"num_files": 3, "num_skipped_files": 0, "num_corpus_tokens": total,
                   "num_distinct_tokens": len(direct), "num_tokens": 16, "vocab_size": VOCAB,
                   "coverage": pytest.approx(pct / 100), "output": str(out_json)}
    assert json.loads(out_json.read_text()) == ids


def test_cli_errors_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture):
    corpus = tmp_path / "c.txt"
    corpus.write_text(CODE[0])
    base = ["token-map", "--model", TARGET, "--data", str(corpus)]

    def run(*extra: str) -> tuple[int, str, str]:
        return _run_main([*base, *extra], capsys)

    missing = tmp_path / "nope"
    _one_error_line(_run_main(["token-map", "--model", TARGET, "--data", str(missing), "--num-tokens",
                                "8", "--output", str(tmp_path / "m.pt")], capsys), "--data", str(missing))
    _one_error_line(run("--num-tokens", "8", "--output", str(tmp_path / "m.txt")), "--output", ".pt")
    _one_error_line(run("--num-tokens", "0", "--output", str(tmp_path / "m.pt")), "--num-tokens")
    line = _one_error_line(run("--num-tokens", str(VOCAB + 1), "--output", str(tmp_path / "m.pt")),
                           "--num-tokens")
    assert str(VOCAB) in line
    _one_error_line(run("--num-tokens", "8", "--output", str(tmp_path / "m.pt"), "--max-bytes", "0"),
                    "--max-bytes")
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    shutil.copy(Path(TARGET) / "config.json", no_tok / "config.json")
    _one_error_line(_run_main(["token-map", "--model", str(no_tok), "--data", str(corpus), "--num-tokens",
                                "8", "--output", str(tmp_path / "m.pt")], capsys), "--model", "tokenizer")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    _one_error_line(_run_main(["token-map", "--model", TARGET, "--data", str(empty), "--num-tokens",
                                "8", "--output", str(tmp_path / "m.pt")], capsys), "--data", "no text")
    assert not (tmp_path / "m.pt").exists()  # no error wrote a map


def test_unwritable_output_is_an_error_naming_it_before_counting(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """An --output under a file was a bare "[Errno 17] File exists" after the whole corpus was
    counted; a save that fails (a read-only folder) was an OSError (or torch's RuntimeError)
    naming no flag."""
    import laguna_dflash.token_map as token_map_module

    corpus = tmp_path / "c.txt"
    corpus.write_text(CODE[0])
    base = ["token-map", "--model", TARGET, "--data", str(corpus), "--num-tokens", "8"]
    monkeypatch.setattr(token_map_module, "count_tokens",
                        lambda *a, **k: pytest.fail("counted the corpus before checking --output"))
    _one_error_line(_run_main([*base, "--output", str(corpus / "sub" / "m.pt")], capsys),
                    "--output", "is a file")
    monkeypatch.undo()

    def read_only(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(token_map_module, "save_token_map", read_only)
    _one_error_line(_run_main([*base, "--output", str(tmp_path / "m.pt")], capsys),
                    "--output", "Permission denied")


def test_model_without_vocab_size(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    cfg = json.loads((Path(TARGET) / "config.json").read_text())
    del cfg["vocab_size"]
    (model / "config.json").write_text(json.dumps(cfg))
    corpus = tmp_path / "c.txt"
    corpus.write_text(CODE[0])
    with pytest.raises(ValueError, match=r"--model .*vocab_size"):
        build_token_map(model, [corpus], 8, tmp_path / "m.pt")
    with pytest.raises(ValueError, match=r"--model .*no such directory"):
        build_token_map(tmp_path / "missing", [corpus], 8, tmp_path / "m.pt")


# --------------------------------------------------------------------------------------------
# The engine: a map built here keeps the target's greedy output
# --------------------------------------------------------------------------------------------


def test_map_from_training_text_keeps_greedy_output(tmp_path: Path):
    """A map of 512 of the 4096 ids, counted from stdlib training files, drives the demo drafter;
    the greedy tokens equal target-only decoding on held-out prompts."""
    files = stdlib_files("train")[:20]
    assert files, "no stdlib files found"
    out = tmp_path / "map.pt"
    summary = build_token_map(TARGET, files, 512, out)
    assert summary.num_files + summary.num_skipped_files == len(files)
    assert 0.5 < summary.coverage < 1.0
    prompts = heldout_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    base = LLM(TARGET).generate(prompts, params)
    spec = LLM(TARGET, DRAFT, speculative_token_map=str(out)).generate(prompts, params)
    for b, s in zip(base, spec):
        assert s.token_ids == b.token_ids
    assert any(s.metrics.get("mean_acceptance_length", 0) > 1 for s in spec)
