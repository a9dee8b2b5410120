"""bench and the demo-style generate: both modes in one run, counters, plot, default pair."""

from __future__ import annotations

import json

import pytest

from laguna_dflash.bench import load_prompts, run_bench, save_acceptance_plot
from laguna_dflash.cli import main
from laguna_dflash.models.random_init import write_random_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), seed=1)


def test_run_bench_reports_both_modes_and_plot(pair, tmp_path, monkeypatch):
    target, draft = pair
    # no tokenizer in the random pair: feed token-id prompts through the text API's encoder
    from laguna_dflash import llm as llm_module

    monkeypatch.setattr(llm_module.LLM, "encode", lambda self, text: [int(t) for t in text.split()])
    prompts = ["5 6 7 8", "9 10 11 12 13 14", "20 21"]
    r = run_bench(str(target), str(draft), prompts, max_new_tokens=12)
    assert r.num_prompts == 3 and r.num_tokens == 3 * 11
    assert r.outputs_identical
    assert r.target_only_tokens_per_s > 0 and r.spec_tokens_per_s > 0
    assert r.speedup == pytest.approx(r.spec_tokens_per_s / r.target_only_tokens_per_s)
    assert len(r.per_position_acceptance_rate) == r.num_speculative_tokens == 7
    assert r.mean_acceptance_length >= 1.0
    png = tmp_path / "acc.png"
    save_acceptance_plot(r, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_prompts_formats(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(["x", "y"]))
    (tmp_path / "b.jsonl").write_text('"x"\n{"prompt": "y"}\n')
    assert load_prompts(tmp_path / "a.json") == ["x", "y"] == load_prompts(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="c.jsonl:1"):
        load_prompts(tmp_path / "c.jsonl")


def test_generate_compare_reports_speedup(pair, capsys):
    target, draft = pair
    assert main(["generate", "--model", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "10", "--ignore-eos", "--json", "--compare"]) == 0
    obj = json.loads(capsys.readouterr().out)
    t = obj["timings"]
    assert t["outputs_identical"] is True and t["target_only_decode_tokens_per_s"] > 0
    assert t["speedup"] == pytest.approx(t["decode_tokens_per_s"] / t["target_only_decode_tokens_per_s"])


def test_generate_without_model_uses_demo_dir(pair, capsys, monkeypatch, tmp_path):
    target, draft = pair
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "target").symlink_to(target)
    (demo / "draft").symlink_to(draft)
    monkeypatch.setenv("LAGUNA_DFLASH_DEMO_DIR", str(demo))
    assert main(["generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos"]) == 0
    out = capsys.readouterr().err
    assert "mean acceptance length" in out and "target-only" in out and "speedup" in out
    monkeypatch.setenv("LAGUNA_DFLASH_DEMO_DIR", str(tmp_path / "missing"))
    assert main(["generate", "--prompt-ids", "1"]) == 2
    assert "embedded demo pair" in capsys.readouterr().err
