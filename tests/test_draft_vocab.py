"""A reduced draft vocabulary (``models/draft_vocab.py``, SGLang's ``--speculative-token-map``).

The file's checks, the frequency ranking, the drafter's drafts (the argmax over the map's rows
of the shared lm_head, mapped back to token ids), and the engine: drafts come from the map only
and the greedy output is still token for token the target's, with the drafter as loaded and in
fp8. The sampled distribution: test_spec_sampling.py; two ranks: test_tensor_parallel.py; the
``token-map`` command that writes a map: test_token_map.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from laguna_dflash.cli import build_parser, main
from laguna_dflash.config import SamplingParams
from laguna_dflash.demo import demo_pair, heldout_prompts
from laguna_dflash.distributed import SINGLE
from laguna_dflash.llm import LLM
from laguna_dflash.models.draft_vocab import (
    load_token_map,
    most_frequent_tokens,
    restrict_rows,
    save_token_map,
)
from laguna_dflash.server.args import resolve_speculative

VOCAB = 4096  # the demo pair's


# ---- the file ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_a_saved_map_loads_as_the_same_ids(tmp_path, suffix) -> None:
    ids = torch.tensor([7, 3, 4095, 0, 12])
    path = save_token_map(ids, tmp_path / f"map{suffix}")
    assert torch.equal(load_token_map(path, VOCAB), ids)


def test_sglangs_forms_load(tmp_path) -> None:
    """SGLang saves a tensor or a list with ``torch.save``; a dict of one tensor is read too."""
    for i, raw in enumerate((torch.tensor([5, 1], dtype=torch.int32), [5, 1], {"hot": torch.tensor([5, 1])})):
        torch.save(raw, tmp_path / f"m{i}.pt")
        got = load_token_map(tmp_path / f"m{i}.pt", VOCAB)
        assert got.dtype == torch.int64 and got.tolist() == [5, 1]


@pytest.mark.parametrize(("raw", "message"), [
    (torch.tensor([1, 2, 2]), "more than once"),
    (torch.tensor([1, VOCAB]), f"token id {VOCAB} is outside the target's vocabulary"),
    (torch.tensor([-1, 3]), "token id -1 is outside"),
    (torch.tensor([], dtype=torch.int64), "empty"),
    (torch.tensor([[1, 2]]), "1-D"),
    (torch.tensor([1.0, 2.0]), "integer token ids"),
    ([1, "2"], "integers only"),
    ("not ids", "expected a 1-D tensor or list"),
])
def test_bad_maps_name_the_flag_and_what_is_wrong(tmp_path, raw, message) -> None:
    path = tmp_path / "map.pt"
    torch.save(raw, path)
    with pytest.raises(ValueError, match=message) as info:
        load_token_map(path, VOCAB)
    assert str(info.value).startswith(f"--speculative-token-map {path}:")


def test_missing_and_unreadable_files_say_what_a_map_is(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file; pass a .pt file of token ids"):
        load_token_map(tmp_path / "nope.pt", VOCAB)
    (tmp_path / "bad.json").write_text("[1, 2,")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_token_map(tmp_path / "bad.json", VOCAB)
    (tmp_path / "bad.pt").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="torch.load failed"):
        load_token_map(tmp_path / "bad.pt", VOCAB)


def test_most_frequent_tokens_ranks_by_count_then_id_and_keeps_the_forced_ids() -> None:
    counts = torch.tensor([5, 0, 9, 5, 1, 0, 7])
    assert most_frequent_tokens(counts, 4).tolist() == [2, 6, 0, 3]
    # id 5 (never counted) forced in: it takes the last place of the unforced ones
    assert most_frequent_tokens(counts, 4, always=(5,)).tolist() == [2, 6, 0, 5]
    # a forced id already in the list costs nothing; out-of-range forced ids are ignored
    assert most_frequent_tokens(counts, 3, always=(2, 99)).tolist() == [2, 6, 0]
    # more than was counted: the ids never seen fill the list in id order
    assert most_frequent_tokens(counts, 7).tolist() == [2, 6, 0, 3, 4, 1, 5]
    with pytest.raises(ValueError, match="--num-tokens must be between 1 and the vocabulary size 7"):
        most_frequent_tokens(counts, 0)
    with pytest.raises(ValueError, match="fewer than the 2 tokens always kept"):
        most_frequent_tokens(counts, 1, always=(1, 5))


def test_restrict_rows_takes_the_rows_in_map_order() -> None:
    weight = torch.randn(10, 3)
    ids = torch.tensor([9, 0, 4])
    assert torch.equal(restrict_rows(weight, ids, SINGLE), weight[[9, 0, 4]])


# ---- the drafter and the engine -----------------------------------------------------------------


def _map(tmp_path, ids: torch.Tensor, name: str = "map.pt") -> str:
    return str(save_token_map(ids, tmp_path / name))


@pytest.fixture(scope="module")
def pair():
    return demo_pair()


def test_drafts_are_the_argmax_over_the_maps_rows(pair, tmp_path) -> None:
    target, draft = pair
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:300]
    drafter = LLM(target, draft, speculative_token_map=_map(tmp_path, ids)).engine.drafter
    assert drafter.draft_head.shape == (300, drafter.lm_head_weight.shape[1])
    hidden = torch.randn(6, drafter.lm_head_weight.shape[1], generator=torch.Generator().manual_seed(2))
    full = hidden @ drafter.lm_head_weight.T  # [6, V]: the shared lm_head's logits
    expected = ids[full[:, ids].argmax(dim=1)]
    got = drafter.draft_tokens(hidden)
    assert torch.equal(got, expected)
    assert not torch.equal(got, full.argmax(dim=1))  # the map changed some drafts (teeth)


def _traced(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [t for o in outs for step in o.metrics["trace"] for t in step["draft_tokens"]]


def test_a_map_of_the_whole_vocabulary_drafts_what_no_map_drafts(pair, tmp_path) -> None:
    """In any order (float32 logits of the demo's prompts hold no exact ties)."""
    target, draft = pair
    prompts = heldout_prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    base = _traced(LLM(target, draft, trace=True), prompts, params)
    shuffled = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
    for ids in (torch.arange(VOCAB), shuffled):
        assert _traced(LLM(target, draft, trace=True, speculative_token_map=_map(tmp_path, ids)),
                       prompts, params) == base


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_greedy_output_is_the_targets_and_drafts_come_from_the_map(pair, tmp_path, quantization) -> None:
    """A map of the demo's most frequent prompt tokens: drafts only from it, the output
    target-only's, acceptance lower than the whole vocabulary's only a little at a half."""
    target, draft = pair
    prompts = heldout_prompts()[:6]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    expected = [o.token_ids for o in LLM(target).generate(prompts, params)]
    tokenizer = LLM(target).tokenizer
    counts = torch.bincount(torch.tensor([t for p in heldout_prompts() for t in tokenizer.encode(p)]),
                            minlength=VOCAB)
    whole = LLM(target, draft, trace=True, draft_quantization=quantization)
    tokens, _ = _traced(whole, prompts, params)
    assert tokens == expected
    for size in (256, 2048):
        ids = most_frequent_tokens(counts, size)
        llm = LLM(target, draft, trace=True, draft_quantization=quantization,
                  speculative_token_map=_map(tmp_path, ids, f"map{size}.pt"))
        if quantization == "fp8":
            assert llm.engine.drafter.lm_head_fp8[0].shape[0] == size  # the map's rows only
        tokens, drafts = _traced(llm, prompts, params)
        assert tokens == expected, size
        assert set(drafts) <= set(ids.tolist())
        assert llm.get_metrics()["num_accepted_tokens"] > 0
    length = llm.get_metrics()["mean_acceptance_length"]  # the 2048-token map
    assert length >= 0.9 * whole.get_metrics()["mean_acceptance_length"]


def test_the_map_needs_a_drafter_and_a_good_file(pair, tmp_path) -> None:
    target, draft = pair
    with pytest.raises(ValueError, match="speculative_token_map was given without draft="):
        LLM(target, speculative_token_map=_map(tmp_path, torch.arange(5)))
    with pytest.raises(ValueError, match="--speculative-token-map .*outside the target's vocabulary"):
        LLM(target, draft, speculative_token_map=_map(tmp_path, torch.tensor([VOCAB + 1]), "big.pt"))


def test_cli_and_server_flags_reach_the_engine(pair, tmp_path, capsys) -> None:
    target, draft = pair
    path = _map(tmp_path, torch.arange(1000))
    assert main(["generate", "--model", target, "--prompt-ids", "5,6", "--speculative-token-map", path]) != 0
    assert "error: --speculative-token-map needs --draft DIR" in capsys.readouterr().err
    code = main(["generate", "--model", target, "--draft", draft, "--prompt-ids", "5,6,7", "--json", "--trace",
                 "--max-new-tokens", "12", "--speculative-token-map", path, "--no-compare"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["token_ids"]) == 12
    drafts = [t for step in out["trace"] for t in step["draft_tokens"]]
    assert drafts and max(drafts) < 1000
    serve = build_parser().parse_args(["serve", "--model", target, "--speculative-draft-model-path", draft,
                                       "--speculative-token-map", path])
    assert resolve_speculative(serve).config.speculative_token_map == path
    alone = build_parser().parse_args(["serve", "--model", target, "--speculative-token-map", path])
    with pytest.raises(ValueError, match="--speculative-token-map needs a drafter"):
        resolve_speculative(alone)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_cuda_greedy_output_is_the_targets_with_a_map(pair, tmp_path, quantization) -> None:
    """On the GPU (float32, CUDA graphs; the fp8 rows through the skinny GEMM's fp8 path): drafts
    from the map only, the output target-only's, and the drafts still good ones."""
    target, draft = pair
    prompts = heldout_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    common = dict(dtype="float32", device="cuda", max_num_seqs=4)
    expected = [o.token_ids for o in LLM(target, **common).generate(prompts, params)]
    tokenizer = LLM(target).tokenizer
    counts = torch.bincount(torch.tensor([t for p in heldout_prompts() for t in tokenizer.encode(p)]),
                            minlength=VOCAB)
    ids = most_frequent_tokens(counts, 2048)
    llm = LLM(target, draft, num_speculative_tokens=7, draft_quantization=quantization, trace=True,
              speculative_token_map=_map(tmp_path, ids), **common)
    tokens, drafts = _traced(llm, prompts, params)
    assert tokens == expected
    assert set(drafts) <= set(ids.tolist())
    assert llm.get_metrics()["mean_acceptance_length"] > 1.5


def test_a_smaller_draft_vocab_size_in_the_config_points_to_the_token_map(pair, tmp_path) -> None:
    """A Laguna drafter's config must keep the target's vocabulary (it shares the lm_head); the
    error says how to draft among fewer tokens instead."""
    import shutil

    target, draft = pair
    copy = Path(shutil.copytree(draft, tmp_path / "draft"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["draft_vocab_size"] = 2048
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="draft_vocab_size=2048 differs .* pass --speculative-token-map"):
        LLM(target, str(copy))
