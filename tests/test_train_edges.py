"""Drafter-training edges: resume from ``train_state.pt`` continues exactly as an uninterrupted
run; a written drafter checkpoint (both flavours) loads back in the engine with the trained
weights."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import laguna_dflash.train.draft as draft_module
from laguna_dflash.models.random_init import write_random_pair
from laguna_dflash.train.draft import DraftTrainConfig, train_draft


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("edges-pair"), seed=4)


def _config(target, out_dir, **kw) -> DraftTrainConfig:
    """A tiny run on pre-written regenerated data (no regeneration through the engine)."""
    out = out_dir
    if not (out / "work" / "regenerated.npy").is_file():
        (out / "work").mkdir(parents=True)
        data = np.random.default_rng(0).integers(5, 500, size=(8, 32)).astype(np.int32)
        np.save(out / "work" / "regenerated.npy", data)
    return DraftTrainConfig(**{"target": str(target), "out_dir": str(out), "num_layers": 1,
                               "block_size": 4, "num_anchors": 4, "prompt_len": 16, "gen_len": 16,
                               "num_sequences": 8, "batch_size": 2, "steps": 4, "warmup": 1,
                               "lr": 3e-3, "save_every": 2, "log_every": 1, "mask_token_id": 3, **kw})


def _state(out) -> dict:
    return torch.load(out / "work" / "train_state.pt", map_location="cpu", weights_only=False)


def test_resume_continues_as_the_uninterrupted_run(random_pair, tmp_path, monkeypatch):
    """Interrupted after the step-2 save and rerun: the same batches and anchors (the data
    generator's state is part of the training state), so the same weights, optimizer state and
    losses as one uninterrupted run."""
    target, _ = random_pair
    whole = train_draft(_config(target, tmp_path / "whole"))
    real_loss = draft_module.draft_loss
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # step 2, after the state of step 2 was written
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(draft_module, "draft_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_draft(_config(target, tmp_path / "resumed"))
    assert _state(tmp_path / "resumed")["step"] == 2
    monkeypatch.setattr(draft_module, "draft_loss", real_loss)
    resumed = train_draft(_config(target, tmp_path / "resumed"))

    want, got = _state(whole), _state(resumed)
    assert got["step"] == want["step"] == 4
    for name, value in want["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    for key, value in want["optimizer"]["state"].items():
        for field in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["optimizer"]["state"][key][field], value[field],
                                       rtol=1e-6, atol=1e-9)
    losses = [json.loads((d / "work" / "train_summary.json").read_text())["losses"] for d in (whole, resumed)]
    assert len(losses[1]) == 4
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


@pytest.mark.parametrize("flavour", ["laguna", "qwen3"])
def test_written_drafter_loads_in_the_engine_with_the_trained_weights(random_pair, tmp_path, flavour):
    """``LLM(target, draft=out)`` holds exactly the trained weights (bf16, as written) under
    their module names, with the trained drafter's taps, block size, mask id and causality."""
    from laguna_dflash import LLM

    target, _ = random_pair
    out = train_draft(_config(target, tmp_path / flavour, flavour=flavour, steps=2, save_every=2))
    trained = _state(out)["model"]
    llm = LLM(str(target), draft=str(out), max_model_len=64, max_num_seqs=2)
    drafter = llm.engine.drafter
    cfg = json.loads((out / "config.json").read_text())
    assert list(drafter.target_layer_ids) == cfg["dflash_config"]["target_layer_ids"]
    assert (drafter.block_size, drafter.mask_token_id) == (4, 3)
    assert drafter.is_causal == (flavour == "laguna")
    params = dict(drafter.named_parameters())
    assert params and set(params) <= set(trained)
    for name, p in params.items():
        want = trained[name].to(torch.bfloat16).float()
        torch.testing.assert_close(p.detach().float().cpu(), want, rtol=0, atol=0, msg=name)


def test_continued_drafter_keeps_its_mask_embedding(random_pair, tmp_path):
    """``init_from`` a drafter that ships ``mask_embedding.pt``: training fills the masked
    slots with it, so the written drafter ships it too and the engine loads the same vector."""
    from laguna_dflash import LLM

    target, draft = random_pair
    init = tmp_path / "init"
    init.mkdir()
    for f in draft.iterdir():
        (init / f.name).write_bytes(f.read_bytes())
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(7))
    torch.save(vector, init / "mask_embedding.pt")
    # the drafter's own shape: a contradicting --num-layers / --block-size is an error
    out = train_draft(_config(target, tmp_path / "cont", init_from=str(init), steps=1, save_every=1,
                              num_layers=2, block_size=8))
    drafter = LLM(str(target), draft=str(out), max_model_len=64, max_num_seqs=2).engine.drafter
    assert drafter.mask_embedding is not None
    torch.testing.assert_close(drafter.mask_embedding.float().cpu(), vector, rtol=0, atol=0)


def test_regenerated_data_of_other_lengths_is_an_error_naming_the_flags(random_pair, tmp_path):
    """``work/regenerated.npy`` is reused as it is: one made with other --prompt-len / --gen-len
    (rows of 32 tokens here, the run asking for 24) was trained on silently, with anchors and
    labels laid out for lengths the rows do not have."""
    c = _config(random_pair[0], tmp_path / "out", gen_len=8)
    with pytest.raises(ValueError, match=r"--prompt-len 16 \+ --gen-len 8 = 24.*delete it"):
        train_draft(c)


def test_resuming_with_other_run_flags_is_an_error_naming_them(random_pair, tmp_path):
    """A state written with --lr 3e-3 --block-size 4, resumed with other values of flags that
    keep the shapes: the run silently mixed two runs' settings (README: a resumed run ends as an
    uninterrupted one). Now a ValueError naming each flag; --steps and the reporting flags may
    still change."""
    target, _ = random_pair
    train_draft(_config(target, tmp_path / "d"))
    with pytest.raises(ValueError, match=r"train_state\.pt.*--block-size 4 there, 8 now.*"
                                         r"--lr 0\.003 there, 0\.01 now.*--out-dir"):
        train_draft(_config(target, tmp_path / "d", lr=1e-2, block_size=8))
    train_draft(_config(target, tmp_path / "d", steps=6, log_every=2))
    assert _state(tmp_path / "d")["step"] == 6


def test_anchors_are_distinct_in_a_row_and_inside_the_generated_part():
    """The recipe samples distinct anchor positions per sequence; drawn with repeats, 32 of 40
    positions repeated some in nearly every row. Rows with fewer positions than anchors repeat."""
    from laguna_dflash.train.draft import draw_anchors

    gen = torch.Generator().manual_seed(0)
    c = DraftTrainConfig(target="t", out_dir="o", prompt_len=16, gen_len=41, num_anchors=32)
    anchors = draw_anchors(c, 64, 57, gen)  # positions 15 .. 55: 41 of them
    assert anchors.shape == (64, 32) and anchors.min() >= 15 and anchors.max() <= 55
    assert all(len(set(row.tolist())) == 32 for row in anchors)
    assert torch.equal(anchors, anchors.sort(dim=1).values)
    short = draw_anchors(replace(c, gen_len=9), 4, 25, gen)  # 9 positions for 32 anchors
    assert short.shape == (4, 32) and short.min() >= 15 and short.max() <= 23


class _FakeClock:
    """``time.perf_counter`` for ``run_training``: each training step costs exactly one second."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _budgeted_run(state_path, clock, *, stop_at: int | None = None) -> tuple[list[float], list[float]]:
    """``run_training`` over a one-parameter model with a 40 s budget on 100 planned steps (one
    second a step, so the re-plan settles on 40 steps); -> (learning rates by step, losses).
    ``stop_at``: interrupted before that step (after the state of the step before was saved)."""
    from laguna_dflash.train.common import run_training

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rates: list[float] = []

    def loss_fn(step: int) -> torch.Tensor:
        if step == stop_at:
            raise KeyboardInterrupt
        clock.now += 1.0
        rates.append(opt.param_groups[0]["lr"])
        return (model.weight * (step + 1)).square().sum()

    losses, _ = run_training("t", model, opt, loss_fn, steps=100, lr=1.0, warmup=2,
                             state_path=state_path, save_every=10, log_every=5, time_budget_s=40.0)
    return rates, losses


def test_resume_under_a_time_budget_continues_the_learning_rate_schedule(tmp_path, monkeypatch):
    """A ``--time-budget-s`` run interrupted at step 20 and resumed: the budget counts the
    seconds already spent and the re-planned schedule carries over, so the resumed run's learning
    rates and step count equal the uninterrupted run's (before, the resumed run planned over
    ``--steps`` again with a fresh clock: its rates jumped up and it ran 40 s more)."""
    import laguna_dflash.train.common as common

    clock = _FakeClock()
    monkeypatch.setattr(common.time, "perf_counter", clock)
    whole_rates, whole_losses = _budgeted_run(tmp_path / "whole.pt", clock)
    assert len(whole_rates) == 40  # the budget cut 100 planned steps to 40

    with pytest.raises(KeyboardInterrupt):
        _budgeted_run(tmp_path / "resumed.pt", clock, stop_at=20)
    clock.now += 500.0  # wall time between the two processes does not count
    resumed_rates, resumed_losses = _budgeted_run(tmp_path / "resumed.pt", clock)
    assert resumed_rates == pytest.approx(whole_rates[20:], rel=1e-12)
    np.testing.assert_allclose(resumed_losses, whole_losses, rtol=1e-6)


def test_default_taps_follow_each_flavours_published_convention():
    """The qwen3 flavour taps as z-lab's ``build_target_layer_ids`` (reference/dflash.md: 1 to
    L - 3; its examples), never the last layer on a target of 3 or more layers (the reference's
    loop would feed it normed); the laguna flavour ends at the last layer, pre-norm, as
    Poolside's published drafters do."""
    from laguna_dflash.train.draft import default_taps

    assert default_taps(32, 5, "qwen3") == [1, 8, 15, 22, 29]
    assert default_taps(36, 5, "qwen3") == [1, 9, 17, 25, 33]
    assert default_taps(64, 5, "qwen3") == [1, 16, 31, 46, 61]
    for depth in range(3, 12):
        assert max(default_taps(depth, 3, "qwen3")) < depth - 1, depth
    assert default_taps(40, 5, "laguna")[-1] == 39 and default_taps(4, 3, "laguna") == [1, 2, 3]
