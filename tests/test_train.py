"""Training: the drafter's training forward equals its inference forward; smoke runs learn."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from laguna_dflash.engine.attention import TorchSDPABackend
from laguna_dflash.engine.kv_cache import KVCache
from laguna_dflash.engine.runner import ForwardItem, ModelRunner
from laguna_dflash.models.loader import load_model
from laguna_dflash.models.random_init import write_random_pair
from laguna_dflash.train.draft import DraftTrainConfig, draft_loss, draw_anchors, train_draft
from laguna_dflash.train.target import TargetTrainConfig, train_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    t, d = write_random_pair(tmp_path_factory.mktemp("pair"), seed=5)
    target = load_model(t)
    drafter = load_model(d, target=target)
    target.prepare_rope(256, "cpu")
    drafter.prepare_rope(256, "cpu")
    return target, drafter


def test_block_training_forward_equals_inference(pair, monkeypatch):
    """Training logits for an anchor = the engine's drafter logits for the same state: context
    K/V of positions < a, block [x_a, MASK...] at a..a+S-1 (causal drafter, windowed layers)."""
    target, drafter = pair
    torch.manual_seed(0)
    seq_len, s = 40, drafter.block_size
    seqs = torch.randint(5, 500, (2, seq_len))
    captured = {}
    real_logits = drafter.compute_logits

    def capture(h):
        captured["logits"] = real_logits(h)
        return captured["logits"]

    monkeypatch.setattr(drafter, "compute_logits", capture)
    cfg = DraftTrainConfig(target="", out_dir="", block_size=s, num_anchors=3, prompt_len=10)
    gen = torch.Generator().manual_seed(1)
    anchors = draw_anchors(cfg, 2, seq_len, torch.Generator().manual_seed(1))
    with torch.no_grad():
        draft_loss(drafter, target, seqs, cfg, gen, anchors=anchors)
    train_logits = captured["logits"].view(2, 3, s - 1, -1)
    monkeypatch.setattr(drafter, "compute_logits", real_logits)
    # inference: the engine path for sequence 0, anchor anchors[0, j]
    kv = KVCache(len(drafter.layers), 8, 16, drafter.num_kv_heads, drafter.head_dim, torch.float32, "cpu")
    runner = ModelRunner(drafter, kv, TorchSDPABackend(), torch.device("cpu"))
    tkv = KVCache(len(target.layers), 8, 16, target.spec.num_kv_heads, target.spec.head_dim, torch.float32, "cpu")
    trunner = ModelRunner(target, tkv, TorchSDPABackend(), torch.device("cpu"))
    table = list(range(8))
    with torch.no_grad():
        _, taps = trunner.forward(seqs[0], [ForwardItem(seq_len, 0, seq_len, table)], drafter.target_layer_ids)
        for j in range(3):
            a = int(anchors[0, j])
            for cache in kv.layers:
                cache[0].zero_()
                cache[1].zero_()
            pos = torch.arange(a)
            drafter.precompute_and_store_context_kv(drafter.combine_hidden_states(taps[:a]), pos, pos, kv.layers)
            ids = [int(seqs[0, a])] + [drafter.mask_token_id] * (s - 1)
            h, _ = runner.forward(ids, [ForwardItem(s, a, a + s, table)], is_causal=drafter.is_causal)
            infer = drafter.compute_logits(h[1:])
            valid = min(s - 1, seq_len - 1 - a)
            torch.testing.assert_close(train_logits[0, j, :valid], infer[:valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flavour,distill", [("laguna", True), ("qwen3", False)])
def test_train_target_and_draft_smoke_loss_goes_down(tmp_path, flavour, distill):
    torch.manual_seed(0)
    tdir = train_target(TargetTrainConfig(
        out_dir=str(tmp_path / "target"), vocab_size=300, hidden_size=64, num_layers=3,
        moe_intermediate_size=32, seq_len=64, batch_size=4, steps=20, warmup=2, lr=3e-3,
        max_corpus_bytes=200_000, log_every=5))
    losses = json.loads((tdir / "work" / "train_summary.json").read_text())["losses"]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 0.5
    ddir = train_draft(DraftTrainConfig(
        target=str(tdir), out_dir=str(tmp_path / "draft"), flavour=flavour, distill=distill,
        num_layers=1, block_size=4, num_anchors=4,
        prompt_len=16, gen_len=16, num_sequences=16, batch_size=4, steps=20, warmup=2, log_every=5,
        gen_batch_size=16))
    losses = json.loads((ddir / "work" / "train_summary.json").read_text())["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    target = load_model(tdir)
    drafter = load_model(ddir, target=target)  # written in the flavour's format, loads strictly
    assert type(drafter).__name__ == {"laguna": "DFlashLaguna", "qwen3": "DFlashDraftModel"}[flavour]


def test_cached_target_states_give_the_same_loss(pair):
    """One target pass kept in memory (CPU: float32) = the target run inside every step."""
    from laguna_dflash.train.draft import cached_target_states

    target, drafter = pair
    seqs = torch.randint(5, 500, (3, 40), generator=torch.Generator().manual_seed(2))
    cfg = DraftTrainConfig(target="", out_dir="", block_size=drafter.block_size, num_anchors=3, prompt_len=10)
    cache = cached_target_states(target, seqs, drafter.target_layer_ids, torch.device("cpu"), chunk=2)
    assert cache[0].shape[:2] == cache[1].shape[:2] == (3, 40)
    idx = torch.tensor([2, 0])
    with torch.no_grad():
        ref = draft_loss(drafter, target, seqs[idx], cfg, torch.Generator().manual_seed(3))
        got = draft_loss(drafter, target, seqs[idx], cfg, torch.Generator().manual_seed(3),
                         (cache[0][idx], cache[1][idx]))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_train_draft_continues_from_a_checkpoint(tmp_path):
    """``init_from`` starts from the given drafter's weights (its first loss is the trained one),
    with the cached-target-states path."""
    torch.manual_seed(0)
    tdir = train_target(TargetTrainConfig(
        out_dir=str(tmp_path / "target"), vocab_size=300, hidden_size=64, num_layers=3,
        moe_intermediate_size=32, seq_len=64, batch_size=4, steps=10, warmup=2, lr=3e-3,
        max_corpus_bytes=200_000, log_every=5))
    common = dict(target=str(tdir), num_layers=1, block_size=4, num_anchors=4, prompt_len=16, gen_len=16,
                  num_sequences=16, batch_size=4, warmup=2, log_every=5, gen_batch_size=16)
    first = train_draft(DraftTrainConfig(out_dir=str(tmp_path / "d1"), steps=30, **common))
    first_losses = json.loads((first / "work" / "train_summary.json").read_text())["losses"]
    second = train_draft(DraftTrainConfig(out_dir=str(tmp_path / "d2"), steps=5, init_from=str(first),
                                          cache_target_states=True, **common))
    second_losses = json.loads((second / "work" / "train_summary.json").read_text())["losses"]
    assert second_losses[0] < first_losses[0] - 0.5
    assert json.loads((second / "config.json").read_text()) == json.loads((first / "config.json").read_text())


# --------------------------------------------------------------------------------------------
# Bad flags: a ValueError naming the flag, before any data is built or a model is loaded
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("steps", 0), ("batch_size", 0), ("seq_len", 0), ("seq_len", 10**8), ("log_every", 0),
    ("save_every", 0), ("lr", 0.0), ("lr", -1.0), ("warmup", -1), ("top_k", 9), ("num_experts", 0),
    ("vocab_size", 100), ("time_budget_s", 0.0), ("device", "bogus"), ("num_layers", 0),
    ("sliding_window", 0),
    # heads of 25 / 18 dims: RoPE's pairs did not fit, a shape error at the first step
    ("hidden_size", 100), ("hidden_size", 72),
])
def test_target_config_rejects_bad_flags(field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        TargetTrainConfig(out_dir="x", **{field: value})


@pytest.mark.parametrize("field,value", [
    ("steps", 0), ("batch_size", 0), ("block_size", 1), ("num_anchors", 0), ("gamma", 0.0),
    ("prompt_len", 0), ("gen_len", 0), ("num_sequences", 0), ("gen_batch_size", 0), ("lr", -1.0),
    ("log_every", 0), ("save_every", 0), ("warmup", -1), ("num_taps", 0), ("num_layers", 0),
    ("flavour", "bogus"), ("mask_token_id", -1), ("device", "bogus"), ("regen_budget_s", -1.0),
])
def test_draft_config_rejects_bad_flags(field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        DraftTrainConfig(target="t", out_dir="x", **{field: value})


def test_cli_train_flag_error_is_one_line(tmp_path, capsys):
    from laguna_dflash.cli import main

    code = main(["train-target", "--out-dir", str(tmp_path / "t"), "--log-every", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.startswith("error:") and "--log-every" in err
    assert not (tmp_path / "t").exists()  # nothing built before the check


def test_cli_train_reports_once_under_torchrun(tmp_path, capsys, monkeypatch):
    """Data-parallel ``train-draft``: rank 0 alone writes, and alone says so."""
    import laguna_dflash.train.draft as draft_module
    from laguna_dflash.cli import main

    monkeypatch.setattr(draft_module, "train_draft", lambda c: c.out_dir)
    argv = ["train-draft", "--target", str(tmp_path), "--out-dir", str(tmp_path / "d")]
    for rank, printed in (("1", ""), ("0", f"wrote {tmp_path / 'd'}\n")):
        monkeypatch.setenv("RANK", rank)
        assert main(argv) == 0
        assert capsys.readouterr().out == printed


def test_out_dir_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ValueError, match="--out-dir"):
        train_target(TargetTrainConfig(out_dir=str(f), steps=1))
    with pytest.raises(ValueError, match="--out-dir"):
        train_draft(DraftTrainConfig(target=str(tmp_path), out_dir=str(f), steps=1))
    # under a file: a bare "[Errno 20] Not a directory" before; now named, before any work
    with pytest.raises(ValueError, match=r"--out-dir .*afile is a file"):
        train_target(TargetTrainConfig(out_dir=str(f / "sub"), steps=1))
    with pytest.raises(ValueError, match=r"--out-dir .*afile is a file"):
        train_draft(DraftTrainConfig(target=str(tmp_path), out_dir=str(f / "sub" / "d"), steps=1))


def test_out_dir_that_cannot_be_made_is_named(tmp_path, monkeypatch):
    """A directory the OS refuses (read-only or missing file system): a ValueError naming
    --out-dir, not a bare OSError."""
    from pathlib import Path

    from laguna_dflash.train.common import make_work_dir

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ValueError, match=r"--out-dir .*Permission denied"):
        make_work_dir(tmp_path / "out")
    with pytest.raises(ValueError, match=r"--out-dir .*Permission denied"):
        train_target(TargetTrainConfig(out_dir=str(tmp_path / "t"), steps=1))


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("rpair"), seed=2)


def _draft_cfg(tmp_path, target, **kw) -> DraftTrainConfig:
    corpus = tmp_path / "tokens.npy"
    if not corpus.exists():
        np.save(corpus, np.random.default_rng(0).integers(5, 500, 4000).astype(np.uint16))
    return DraftTrainConfig(**{"target": str(target), "out_dir": str(tmp_path / "d"), "num_layers": 1,
                               "block_size": 4, "num_anchors": 4, "prompt_len": 16, "gen_len": 16,
                               "num_sequences": 8, "batch_size": 4, "steps": 2, "warmup": 1,
                               "gen_batch_size": 8, "mask_token_id": 3, "corpus_tokens": str(corpus),
                               **kw})


def test_train_draft_checks_target_and_init_from_before_regenerating(random_pair, tmp_path, monkeypatch):
    """A wrong --target / --init-from / --corpus-tokens is reported before the (long)
    regeneration, naming the flag."""
    import laguna_dflash.train.draft as draft_module

    target, draft = random_pair
    monkeypatch.setattr(draft_module, "_regenerate_part",
                        lambda *a, **k: pytest.fail("regenerated before checking the flags"))
    with pytest.raises(ValueError, match=rf"--target.*{re.escape(str(tmp_path / 'missing'))}"):
        train_draft(_draft_cfg(tmp_path, tmp_path / "missing"))
    with pytest.raises(ValueError, match="--target.*drafter"):
        train_draft(_draft_cfg(tmp_path, draft))
    with pytest.raises(ValueError, match="--init-from.*not a DFlash drafter"):
        train_draft(_draft_cfg(tmp_path, target, init_from=str(target)))
    with pytest.raises(ValueError, match="--mask-token-id"):
        train_draft(_draft_cfg(tmp_path, target, mask_token_id=512))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        train_draft(_draft_cfg(tmp_path, target, prompt_len=64, gen_len=5000))
    with pytest.raises(ValueError, match="--num-taps 9: the target's 4 layers give 3 distinct"):
        train_draft(_draft_cfg(tmp_path, target, num_taps=9))  # it silently got 3 taps
    short = tmp_path / "short.npy"
    np.save(short, np.arange(10, dtype=np.uint16))
    with pytest.raises(ValueError, match="--corpus-tokens.*--prompt-len"):
        train_draft(_draft_cfg(tmp_path, target, corpus_tokens=str(short)))
    text = tmp_path / "text.npy"
    text.write_text("not numpy")
    with pytest.raises(ValueError, match="--corpus-tokens"):
        train_draft(_draft_cfg(tmp_path, target, corpus_tokens=str(text)))
    with pytest.raises(ValueError, match="--corpus-tokens .*missing.npy: no such file"):
        train_draft(_draft_cfg(tmp_path, target, corpus_tokens=str(tmp_path / "missing.npy")))


def test_init_from_is_checked_against_the_target_and_the_flags_before_regenerating(
        random_pair, tmp_path, monkeypatch):
    """An --init-from drafter of another target failed only after the regeneration, in a
    message naming no flag; a drafter flag that contradicts it (its config wins) was silently
    ignored: --block-size 4 wrote a drafter of block 8."""
    import laguna_dflash.train.draft as draft_module
    from laguna_dflash.demo import demo_pair

    target, draft = random_pair  # its drafter: 2 layers, block 8, 3 taps, mask token 3
    monkeypatch.setattr(draft_module, "_regenerate_part",
                        lambda *a, **k: pytest.fail("regenerated before checking the flags"))
    own = {"num_layers": 2, "block_size": 8}
    with pytest.raises(ValueError, match="--init-from .*hidden_size 256 differs from --target's hidden_size 64"):
        train_draft(_draft_cfg(tmp_path, target, init_from=demo_pair()[1], **own))
    for flags, flag in (({"block_size": 4}, "--block-size 4"), ({"num_layers": 1}, "--num-layers 1"),
                        ({"flavour": "qwen3"}, "--flavour qwen3"), ({"num_taps": 2}, "--num-taps 2"),
                        ({"mask_token_id": 5}, "--mask-token-id 5")):
        with pytest.raises(ValueError, match=f"{flag} contradicts --init-from"):
            train_draft(_draft_cfg(tmp_path, target, init_from=str(draft), **{**own, **flags}))


def test_resuming_with_other_model_flags_is_a_clear_error(tmp_path):
    """The out dir's training state (or tokenizer) from a run with other model flags: a
    ValueError that says to keep the flags or use a new --out-dir, not a load_state_dict dump
    or an index error deep in the model."""
    common = dict(out_dir=str(tmp_path / "t"), vocab_size=300, num_layers=2, moe_intermediate_size=32,
                  seq_len=16, batch_size=2, steps=2, warmup=1, max_corpus_bytes=100_000, log_every=1)
    train_target(TargetTrainConfig(hidden_size=64, save_every=1, **common))
    with pytest.raises(ValueError, match=r"train_state\.pt.*--out-dir"):
        train_target(TargetTrainConfig(hidden_size=128, save_every=1, **common))
    (tmp_path / "t" / "work" / "train_state.pt").unlink()
    with pytest.raises(ValueError, match=r"--vocab-size.*--out-dir"):
        train_target(TargetTrainConfig(hidden_size=64, save_every=1, **{**common, "vocab_size": 270}))
