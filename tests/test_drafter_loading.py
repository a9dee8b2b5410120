"""Drafter checkpoints: both formats load; config errors name the field; spec CLI flags work."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.cli import main
from laguna_dflash.models.loader import CheckpointError, load_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("drafters")
    target = df.make_tiny_laguna_target(root / "target", seed=2)
    return {
        "target": target,
        "poolside": df.make_poolside_laguna_drafter(root / "poolside", target, seed=4, block_size=4),
        "zlab": df.make_zlab_drafter(root / "zlab", target, seed=4, num_layers=2, block_size=4,
                                     block_size_top_level=True),
    }


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key == "dflash_config":
            cfg["dflash_config"].update(value)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_formats_and_top_level_fallbacks(ckpts):
    target = load_model(ckpts["target"])
    pool = load_model(ckpts["poolside"], target=target)
    zlab = load_model(ckpts["zlab"], target=target)
    assert type(pool).__name__ == "DFlashLaguna" and pool.is_causal and pool.block_size == 4
    assert type(zlab).__name__ == "DFlashDraftModel" and not zlab.is_causal
    assert zlab.block_size == 4  # read from the top level (z-lab's published placement)
    assert pool.layers[0].self_attn.gating == "per-head"
    assert pool.layers[0].self_attn.sliding_window is not None  # compute-time window


@pytest.mark.parametrize("changes,needle", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must be uniform"),
    ({"draft_vocab_size": 1000}, "draft_vocab_size=1000"),
    ({"dflash_config": {"target_layer_ids": []}}, "target_layer_ids is empty"),
    ({"dflash_config": {"target_layer_ids": [1, 9]}}, r"target_layer_ids \[9\]"),
    ({"dflash_config": {"mask_token_id": None}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 5000}}, "outside the target vocabulary"),
    ({"num_experts": 4}, "num_experts must be 0"),
])
def test_laguna_drafter_config_errors(ckpts, tmp_path, changes, needle):
    bad = _copy_with_config(ckpts["poolside"], tmp_path / "bad", **changes)
    target = load_model(ckpts["target"])
    with pytest.raises(ValueError, match=needle):
        load_model(bad, target=target)


def test_a_drafter_of_another_width_is_refused_at_load(ckpts, tmp_path):
    """A drafter built for a target of another hidden size (its config and weights agreeing)
    loaded and failed at its first step with a shape error naming neither model; now the load
    names the field and both widths, for the Laguna and the Qwen3 flavour."""
    import dflash_fixtures as df

    target = load_model(ckpts["target"])
    width = target.spec.hidden_size
    wide = df.make_poolside_laguna_drafter(tmp_path / "wide", ckpts["target"], seed=1, block_size=4,
                                           hidden_size=2 * width, intermediate_size=4 * width, head_dim=16)
    with pytest.raises(ValueError, match=f"hidden_size {2 * width} differs from the target's hidden_size {width}"):
        load_model(wide, target=target)
    for name in ("poolside", "zlab"):
        bad = _copy_with_config(ckpts[name], tmp_path / f"{name}_taps", target_hidden_size=2 * width)
        with pytest.raises(ValueError, match=f"target_hidden_size {2 * width} differs"):
            load_model(bad, target=target)
    with pytest.raises(ValueError, match="pair it with the target it was trained for"):
        LLM(str(ckpts["target"]), draft=str(wide))


def test_fc_width_mismatch_names_tensor(ckpts, tmp_path):
    bad = _copy_with_config(ckpts["zlab"], tmp_path / "bad", dflash_config={"target_layer_ids": [1]})
    target = load_model(ckpts["target"])
    with pytest.raises(CheckpointError, match=r"fc.weight .*shape"):
        load_model(bad, target=target)


def test_missing_and_unexpected_drafter_tensors(ckpts, tmp_path):
    target = load_model(ckpts["target"])
    for mode in ("missing", "unexpected"):
        bad = tmp_path / mode
        shutil.copytree(ckpts["poolside"], bad)
        tensors = load_file(bad / "model.safetensors")
        if mode == "missing":
            del tensors["aux_hidden_norms.1.weight"]
        else:
            tensors["layers.0.self_attn.extra.weight"] = torch.zeros(2)
        save_file(tensors, bad / "model.safetensors")
        needle = "aux_hidden_norms.1.weight" if mode == "missing" else "layers.0.self_attn.extra.weight"
        with pytest.raises(CheckpointError, match=needle):
            load_model(bad, target=target)


def test_mask_embedding_file_replaces_mask_rows(ckpts, tmp_path):
    d = tmp_path / "with_mask"
    shutil.copytree(ckpts["zlab"], d)
    hidden = json.loads((d / "config.json").read_text())["hidden_size"]
    emb = torch.randn(hidden)
    torch.save(emb, d / "mask_embedding.pt")
    target = load_model(ckpts["target"])
    drafter = load_model(d, target=target)
    ids = torch.tensor([1, drafter.mask_token_id, 2])
    h = drafter.embed(ids)
    torch.testing.assert_close(h[1], emb)
    torch.testing.assert_close(h[0], target.embed_tokens.weight[1])


def test_draft_passed_as_model_and_target_as_draft_are_errors(ckpts):
    with pytest.raises(ValueError, match="pass it as draft="):
        LLM(ckpts["poolside"])
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        LLM(ckpts["target"], draft=ckpts["target"])


def test_cli_spec_json_counters_and_trace(ckpts, capsys):
    args = ["generate", "--model", str(ckpts["target"]), "--prompt-ids", "4,8,15,16,23,42",
            "--max-new-tokens", "20", "--ignore-eos", "--json"]
    assert main(args + ["--no-spec", "--draft", str(ckpts["poolside"])]) == 0
    base = json.loads(capsys.readouterr().out)
    assert "num_drafts" not in base
    assert main(args + ["--draft", str(ckpts["poolside"]), "--num-speculative-tokens", "2", "--trace"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == base["token_ids"]
    assert spec["num_draft_tokens"] == 2 * spec["num_drafts"] and len(spec["trace"]) == spec["num_drafts"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    step = spec["trace"][0]
    assert step["anchor_position"] == 6 and len(step["draft_tokens"]) == 2
    assert 0 <= step["num_accepted"] <= 2
    assert main(["generate", "--model", str(ckpts["target"]), "--prompt-ids", "1",
                 "--num-speculative-tokens", "3"]) == 2
    assert "needs --draft" in capsys.readouterr().err


def test_smaller_k_than_block_and_llm_api(ckpts):
    llm = LLM(ckpts["target"], draft=ckpts["poolside"], num_speculative_tokens=1)
    assert llm.engine.num_speculative_tokens == 1
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=5))
    assert out[0].metrics["num_draft_tokens"] == out[0].metrics["num_drafts"]
    with pytest.raises(ValueError, match="without draft"):
        LLM(ckpts["target"], num_speculative_tokens=2)


def test_qwen3_drafter_layer_attention_resolution():
    """vLLM's per-layer rules: layer_types -> sliding layers causal + windowed, full layers
    bidirectional; use_swa -> all windowed and bidirectional; is_causal / dflash_config.causal
    override causality for every layer."""
    from laguna_dflash.models.dflash import resolve_qwen3_draft_layers

    mixed = resolve_qwen3_draft_layers(
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, 2)
    assert [(s.sliding_window, s.is_causal) for s in mixed] == [(8, True), (None, False)]
    swa = resolve_qwen3_draft_layers({"use_swa": True, "sliding_window": 8}, 2)
    assert [(s.sliding_window, s.is_causal) for s in swa] == [(8, False), (8, False)]
    forced = resolve_qwen3_draft_layers({"dflash_config": {"causal": True}}, 2)
    assert all(s.is_causal and s.sliding_window is None for s in forced)
    with pytest.raises(ValueError, match="sliding_window"):
        resolve_qwen3_draft_layers({"use_swa": True}, 1)


def test_attention_sink_bias_loads_and_very_negative_sinks_change_nothing(ckpts, tmp_path):
    """dflash_config.attention_sink_bias adds a per-head sink logit to every drafter layer; a sink
    of -1e4 contributes nothing, so drafts equal the sink-free drafter's."""
    base_dir = ckpts["zlab"]
    sink_dir = _copy_with_config(base_dir, tmp_path / "sinks", dflash_config={"attention_sink_bias": True})
    tensors = load_file(sink_dir / "model.safetensors")
    heads = json.loads((sink_dir / "config.json").read_text())["num_attention_heads"]
    for i in range(2):
        tensors[f"layers.{i}.self_attn.sinks"] = torch.full((heads,), -1e4)
    save_file(tensors, sink_dir / "model.safetensors")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    plain = LLM(ckpts["target"], draft=base_dir, trace=True).generate(prompt_token_ids=prompts, sampling_params=params)
    sinked_llm = LLM(ckpts["target"], draft=sink_dir, trace=True)
    assert sinked_llm.engine.drafter.layers[0].self_attn.sinks is not None
    sinked = sinked_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.metrics["trace"] for o in sinked] == [o.metrics["trace"] for o in plain]
    # and a large positive sink really changes the drafts (the parameter is used)
    for i in range(2):
        tensors[f"layers.{i}.self_attn.sinks"] = torch.full((heads,), 30.0)
    save_file(tensors, sink_dir / "model.safetensors")
    loud = LLM(ckpts["target"], draft=sink_dir, trace=True).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in loud] == [o.token_ids for o in plain]  # still lossless
    assert [o.metrics["trace"] for o in loud] != [o.metrics["trace"] for o in plain]
