"""Data-parallel drafter training (``torchrun ... train-draft``) on two CPU ranks over gloo.

Each rank computes its half of every batch (the same global rows and anchors, the loss
normalised by the whole batch's weight) and the gradients are summed over the ranks, so two
ranks take the optimizer steps one process takes on the whole batch: the weights after a few
steps match one process's, the regeneration is split between the ranks, and rank 0 alone writes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

STEPS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny trained-format target and a regenerated-data cache both runs share."""
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("dp")
    target = df.make_tiny_laguna_target(root / "laguna", seed=0)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    data = rng.integers(5, vocab, size=(16, 32)).astype(np.int32)
    return root, target, data


def _config(target, out_dir, **overrides) -> dict:
    return {**dict(target=str(target), out_dir=str(out_dir), flavour="laguna", num_layers=1,
                   block_size=4, num_anchors=4, prompt_len=16, gen_len=16, num_sequences=16,
                   batch_size=4, steps=STEPS, warmup=1, lr=3e-3, save_every=STEPS, log_every=1,
                   mask_token_id=3), **overrides}


def _with_data(out_dir, data) -> None:
    (out_dir / "work").mkdir(parents=True)
    np.save(out_dir / "work" / "regenerated.npy", data)


def test_two_ranks_take_one_process_steps(setup):
    import tp_worker

    root, target, data = setup
    for name in ("one", "two"):
        _with_data(root / name, data)
    one = tp_worker.run_job({"kind": "train_draft", "config": _config(target, root / "one")}, 1)
    two = tp_worker.run_ranks([{"kind": "train_draft", "config": _config(target, root / "two")}],
                              world_size=2)[0][0]
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
    summary = json.loads((root / "two" / "work" / "train_summary.json").read_text())
    assert summary["num_ranks"] == 2 and len(summary["losses"]) == STEPS
    want = json.loads((root / "one" / "work" / "train_summary.json").read_text())["losses"]
    np.testing.assert_allclose(summary["losses"], want, rtol=1e-4)
    assert (root / "two" / "config.json").is_file()


def test_cached_target_states_are_split_between_the_ranks(setup):
    """With ``cache_target_states`` each rank computes and keeps every second sequence's target
    states and fetches the rest of its batch rows from the other rank: the same steps as one
    process keeping them all."""
    import tp_worker

    root, target, data = setup
    for name in ("one-cached", "two-cached"):
        _with_data(root / name, data)
    cfg = dict(cache_target_states=True)
    one = tp_worker.run_job({"kind": "train_draft", "config": _config(target, root / "one-cached", **cfg)}, 1)
    two = tp_worker.run_ranks([{"kind": "train_draft",
                                "config": _config(target, root / "two-cached", **cfg)}], world_size=2)[0][0]
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
    summary = json.loads((root / "two-cached" / "work" / "train_summary.json").read_text())
    want = json.loads((root / "one-cached" / "work" / "train_summary.json").read_text())
    assert (summary["num_cached_sequences"], want["num_cached_sequences"]) == (8, 16)
    np.testing.assert_allclose(summary["losses"], want["losses"], rtol=1e-4)


def test_batch_states_fetch_each_row_from_the_rank_keeping_it():
    """Three ranks, each keeping every third sequence: every rank gets exactly its slice of a
    global batch's rows, in order (repeats, two rows in one message, a rank sending nothing to
    one peer)."""
    import tp_worker

    idx = [4, 0, 7, 4, 2, 9, 5, 5, 1]  # slices [4, 0, 7], [4, 2, 9], [5, 5, 1] of 10 sequences
    results = tp_worker.run_ranks([{"kind": "batch_states", "num_sequences": 10, "idx": idx}],
                                  world_size=3)
    gen = torch.Generator().manual_seed(0)
    hidden, taps = torch.randn(10, 3, 4, generator=gen), torch.randn(10, 3, 8, generator=gen)
    for rank, [(got_hidden, got_taps)] in enumerate(results):
        want = torch.tensor(idx[rank * 3 : rank * 3 + 3])
        assert torch.equal(got_hidden, hidden[want]) and torch.equal(got_taps, taps[want]), rank


def test_batch_size_must_divide_over_the_ranks(setup):
    import tp_worker

    root, target, data = setup
    _with_data(root / "odd", data)
    with pytest.raises(Exception, match="batch-size 3 is not divisible by the 2 launched ranks"):
        tp_worker.run_ranks([{"kind": "train_draft",
                              "config": _config(target, root / "odd", batch_size=3)}], world_size=2)
    shutil.rmtree(root / "odd")


def test_regeneration_is_split_between_the_ranks(setup):
    """Without a cache each rank continues every second prompt; rank 0 joins the parts: the
    rows are one process's rows (rank 0's prompts first, then rank 1's)."""
    import tp_worker

    root, target, data = setup
    corpus = root / "corpus.npy"
    np.save(corpus, data.reshape(-1))
    cfg = {"corpus_tokens": str(corpus), "num_sequences": 6, "gen_len": 8, "steps": 1,
           "save_every": 1, "gen_batch_size": 4}
    tp_worker.run_job({"kind": "train_draft", "config": _config(target, root / "r1", **cfg)}, 1)
    tp_worker.run_ranks([{"kind": "train_draft", "config": _config(target, root / "r2", **cfg)}],
                        world_size=2)
    one = np.load(root / "r1" / "work" / "regenerated.npy")
    two = np.load(root / "r2" / "work" / "regenerated.npy")
    assert one.shape == two.shape == (6, 24)
    np.testing.assert_array_equal(two, np.concatenate([one[0::2], one[1::2]]))
    assert sorted((root / "r2" / "work").glob("regenerated.rank*")) == []


def test_train_target_on_two_ranks_takes_one_process_steps(tmp_path):
    """``torchrun ... train-target``: two data-parallel ranks (each half of every batch, the
    expert loads summed before the bias update) end with one process's weights, expert biases
    included; rank 0 alone writes (before, every rank trained the whole batch on its own and
    all wrote the same files)."""
    import tp_worker

    cfg = dict(vocab_size=300, hidden_size=32, num_layers=2, num_experts=4, moe_intermediate_size=16,
               seq_len=32, batch_size=4, steps=STEPS, warmup=1, lr=3e-3, max_corpus_bytes=60_000,
               save_every=STEPS, log_every=1)
    one = tp_worker.run_job({"kind": "train_target", "config": {**cfg, "out_dir": str(tmp_path / "one")}}, 1)
    two = tp_worker.run_ranks([{"kind": "train_target", "config": {**cfg, "out_dir": str(tmp_path / "two")}}],
                              world_size=2)
    assert one.keys() == two[0][0].keys()
    biases = [name for name in one if name.endswith("e_score_correction_bias")]
    assert biases and any(one[name].abs().max() > 0 for name in biases)  # balancing moved them
    for name in one:
        torch.testing.assert_close(two[0][0][name], one[name], rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(two[1][0][name], two[0][0][name]), name  # the ranks agree
    summary = json.loads((tmp_path / "two" / "work" / "train_summary.json").read_text())
    want = json.loads((tmp_path / "one" / "work" / "train_summary.json").read_text())["losses"]
    assert summary["num_ranks"] == 2
    np.testing.assert_allclose(summary["losses"], want, rtol=1e-4)
