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


def test_load_prompts_errors_name_the_flag_and_the_entry(tmp_path):
    """A {"text": ...} record said "got None", an undecodable file gave a bare codec error and an
    empty prompt failed in the engine after both models loaded; {"prompt_token_ids": [...]}
    (for a model without a tokenizer) is a prompt, as in vLLM."""
    cases = {"a.jsonl": ('{"prompt": "x"}\n{"text": "y"}\n', r"--prompts .*a\.jsonl:2: .*keys \['text'\]"),
             "b.json": ('["x", ""]', r"--prompts .*b\.json\[1\]: the prompt is empty"),
             "c.json": ('[{"prompt_token_ids": []}]', r"--prompts .*c\.json\[0\]: \"prompt_token_ids\""),
             "d.json": ('[{"prompt_token_ids": [1, "2"]}]', r"--prompts .*d\.json\[0\]")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            load_prompts(tmp_path / name)
    (tmp_path / "e.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError, match=r"--prompts .*e\.jsonl: not UTF-8"):
        load_prompts(tmp_path / "e.jsonl")
    (tmp_path / "f.jsonl").write_text('{"prompt_token_ids": [5, 6]}\n"x"\n')
    assert load_prompts(tmp_path / "f.jsonl") == [{"prompt_token_ids": [5, 6]}, "x"]


def test_bench_simulated_acceptance_reaches_the_speculative_run(pair, tmp_path, capsys):
    """``bench --simulate-acceptance-length 3`` was accepted and dropped: the run measured the
    real drafter (mean acceptance length 1 on a random pair). Token-id prompts need no tokenizer."""
    target, draft = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6, 7, 8]}\n{"prompt_token_ids": [9, 10, 11]}\n')
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--prompts", str(prompts),
                 "--max-new-tokens", "17", "--simulate-acceptance-length", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["simulate_acceptance_length"] == 3.0
    assert result["mean_acceptance_length"] == pytest.approx(3.0, abs=0.5)


def test_generate_compare_reports_speedup(pair, capsys, monkeypatch):
    """``--compare`` runs DFlash and target-only in alternation (3 rounds by default,
    ``--compare-rounds``) and reports each one's best round, with every round's speed."""
    from laguna_dflash import llm as llm_module

    order, real_generate = [], llm_module.LLM.generate

    def recording(self, *args, **kwargs):
        order.append("spec" if self.config.speculative is not None else "target")
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "generate", recording)
    target, draft = pair
    argv = ["generate", "--model", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7",
            "--max-new-tokens", "10", "--ignore-eos", "--json", "--compare"]
    for extra, rounds in (([], 3), (["--compare-rounds", "2"], 2)):
        order.clear()
        assert main([*argv, *extra]) == 0
        t = json.loads(capsys.readouterr().out)["timings"]
        assert order == ["spec", "target"] * rounds
        assert t["compare_rounds"] == rounds and t["outputs_identical"] is True
        for key in ("decode_tokens_per_s", "target_only_decode_tokens_per_s"):
            per_round = t[f"{key}_per_round"]
            assert len(per_round) == rounds and min(per_round) > 0 and t[key] == max(per_round)
        assert t["speedup"] == pytest.approx(t["decode_tokens_per_s"] / t["target_only_decode_tokens_per_s"])
    # the stats line says what the speeds are
    assert main([*argv[:-2], "--compare", "--compare-rounds", "2"]) == 0  # no --json
    assert "(best of 2 alternating runs each)" in capsys.readouterr().err


def test_generate_compare_checks_every_rounds_tokens(pair, capsys, monkeypatch):
    """``outputs_identical`` covers every round of both engines, not only the first DFlash run:
    a later DFlash round whose tokens differ makes it False."""
    from laguna_dflash import llm as llm_module

    calls, real_generate = [], llm_module.LLM.generate

    def second_spec_run_differs(self, *args, **kwargs):
        outs = real_generate(self, *args, **kwargs)
        if self.config.speculative is not None:
            calls.append(1)
            if len(calls) == 2:
                outs[0].token_ids[-1] += 1
        return outs

    monkeypatch.setattr(llm_module.LLM, "generate", second_spec_run_differs)
    target, draft = pair
    assert main(["generate", "--model", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "10", "--ignore-eos", "--json", "--compare"]) == 0
    assert json.loads(capsys.readouterr().out)["timings"]["outputs_identical"] is False


@pytest.mark.parametrize("extra,message", [
    (["--compare", "--compare-rounds", "0"], "--compare-rounds must be at least 1, got 0"),
    (["--no-compare", "--compare-rounds", "2"], "it needs --compare"),
])
def test_generate_compare_rounds_errors_name_the_flag(pair, capsys, extra, message):
    target, draft = pair
    assert main(["generate", "--model", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "4", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


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


def _config_only(src, dst):
    """A checkpoint directory as a user has it before the weights are downloaded: config only."""
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    return dst


def test_load_format_dummy_reads_only_config(pair, tmp_path, capsys):
    """``--load-format dummy`` builds both models from config.json alone (seeded, so the same
    weights every time: two runs agree, and DFlash output equals target-only); without the
    flag the same directories fail with one error line naming the missing weights."""
    target = _config_only(pair[0], tmp_path / "target")
    draft = _config_only(pair[1], tmp_path / "draft")
    argv = ["generate", "--model", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7",
            "--max-new-tokens", "8", "--ignore-eos", "--json", "--compare"]
    runs = []
    for _ in range(2):
        assert main([*argv, "--load-format", "dummy"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert len(runs[0]["token_ids"]) == 8 and runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[0]["timings"]["outputs_identical"] is True
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "error:" in err and "safetensors" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--load-format", "random"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--load-format" in err and "'dummy'" in err


def test_bench_passes_every_engine_flag_to_both_runs(pair, tmp_path, capsys, monkeypatch):
    """bench's two LLMs get the same engine flags (max model length, KV blocks, load format...):
    the runs differ only in the drafter."""
    from laguna_dflash import bench as bench_module
    from laguna_dflash import llm as llm_module

    seen = []

    class RecordingLLM(llm_module.LLM):
        def __init__(self, model, **kwargs):
            seen.append(kwargs)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(bench_module, "LLM", RecordingLLM)
    monkeypatch.setattr(llm_module.LLM, "encode", lambda self, text: [int(t) for t in text.split()])
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["5 6 7 8", "9 10 11"]))
    target = _config_only(pair[0], tmp_path / "target")
    draft = _config_only(pair[1], tmp_path / "draft")
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--max-model-len", "96", "--num-kv-blocks", "40",
                 "--block-size", "8", "--load-format", "dummy", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outputs_identical"] is True
    assert len(seen) == 2 and "draft" in seen[1] and "draft" not in seen[0]
    for kwargs in seen:
        assert kwargs["max_model_len"] == 96 and kwargs["num_kv_blocks"] == 40
        assert kwargs["block_size"] == 8 and kwargs["load_format"] == "dummy"
        assert kwargs["batch_invariant"] is False


@pytest.mark.parametrize("dtype,expected", [
    ("float32", "TOKENS DIFFER from target-only"),
    ("bfloat16", "tokens differ from target-only (bfloat16 rounds differently per batch shape; "
                 "exact in float32 or with --batch-invariant)"),
])
def test_generate_compare_names_why_tokens_differ(pair, capsys, monkeypatch, dtype, expected):
    """A difference is an alarm in float32 (lossless is exact there) and expected rounding in
    half precision; the stats line says which (the target-only run's tokens are altered here)."""
    from laguna_dflash import llm as llm_module

    real_generate = llm_module.LLM.generate

    def altered(self, *args, **kwargs):
        outs = real_generate(self, *args, **kwargs)
        if self.config.speculative is None:
            outs[0].token_ids[-1] += 1
        return outs

    monkeypatch.setattr(llm_module.LLM, "generate", altered)
    target, draft = pair
    assert main(["generate", "--model", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "6", "--ignore-eos", "--compare", "--dtype", dtype]) == 0
    assert expected in capsys.readouterr().err
