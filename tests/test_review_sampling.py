"""Review of the sampling and speculative-verification path: cases the other sampler and
speculative tests do not reach (each failed before its fix)."""

from __future__ import annotations

import pytest
import torch

import laguna_dflash.engine.sampler as sampler
from laguna_dflash.config import SamplingParams
from laguna_dflash.engine.sampler import filtered_probs, filtered_probs_rows, sample_rows


@pytest.mark.parametrize("columns", [None, 16], ids=["default-columns", "16-columns"])
@pytest.mark.parametrize("mate_k, own_k, own_min_p", [
    ("fill", 0, 0.0),  # no top-k of its own
    ("fill", 0, 1e-4),  # min-p only (its floor far below the columns' last score)
    ("below", "above", 0.0),  # a top-k above the ranked columns: the batch takes the full sort
])
def test_a_row_without_top_p_is_not_cut_to_a_batch_mates_ranked_columns(monkeypatch, columns, mate_k,
                                                                         own_k, own_min_p):
    """A row with top-p on its top-k's ranked columns (k <= TOPK_MAX_COLUMNS) beside a row with
    no top-p and no top-k (or a top-k above the columns): the second row keeps exactly what it
    keeps alone. Before the fix its "boundary" was the last ranked column's score, so it was cut
    to the batch's top TOPK_MAX_COLUMNS tokens: its distribution (and a seeded request's tokens)
    depended on its batch mates."""
    if columns is not None:
        monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", columns)
    width = sampler.TOPK_MAX_COLUMNS
    vocab = 2 * width + 37
    # nearly flat rows: most of the mass lies outside the top TOPK_MAX_COLUMNS tokens
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 0.3
    mate = width if mate_k == "fill" else width // 2  # ranked: k <= TOPK_MAX_COLUMNS, with top-p
    own = 0 if own_k == 0 else width + 5  # no top-k, or one that takes the full sort
    temperature, top_k, top_p, min_p = [0.9, 1.1], [mate, own], [0.8, 1.0], [0.0, own_min_p]
    rows = filtered_probs_rows(logits, temperature, top_k, top_p, min_p)
    alone = filtered_probs(logits[1:], temperature[1], own, 1.0, own_min_p)[0]
    assert int((alone > 0).sum()) > width  # alone it keeps more than the columns hold
    assert torch.equal(rows[1], alone)
    # the mate's own filtering is untouched by the fix
    assert torch.equal(rows[0], filtered_probs(logits[:1], 0.9, mate, 0.8)[0])
    # the sampler itself: a seeded request picks the same tokens alone and beside the mate, at
    # 48 output positions (a verify's rows), a quarter of its mass outside the columns or more
    params = [SamplingParams(temperature=0.9, top_k=mate, top_p=0.8, seed=5),
              SamplingParams(temperature=1.1, top_k=own, min_p=own_min_p, seed=7)]
    rows_per_request = 48
    block = logits.repeat_interleave(rows_per_request, dim=0)  # [2 * 48, V]
    batch = sample_rows(block, params, [0, 0], rows_per_request)
    single = sample_rows(block[rows_per_request:], params[1:], [0], rows_per_request)
    assert torch.equal(batch[rows_per_request:], single)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A tiny Qwen3 target (vocabulary 24) and a one-layer drafter on it (block of 4)."""
    import dflash_fixtures as df

    return df.make_small_vocab_pair(tmp_path_factory.mktemp("review_sampling"))


def test_a_seeded_request_samples_the_same_beside_a_ranked_top_p_mate(tiny_pair, monkeypatch):
    """Engine level, with and without speculation: a seeded request with no top-p and no top-k
    gives the same tokens alone and batched with a request whose top-p runs on its top-k's
    ranked columns (here 4 of the 24 tokens, so that the columns are full). Before the fix the
    batched request was cut to the mate's columns' tokens and sampled other tokens."""
    from laguna_dflash import LLM

    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 4)
    target, draft = tiny_pair
    prompts = [[3, 14, 15, 9, 2, 6], [5, 1, 7]]
    wide = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True, seed=21)
    mate = SamplingParams(temperature=0.8, top_k=4, top_p=0.7, max_tokens=24, ignore_eos=True, seed=3)
    base = LLM(target, max_num_seqs=4)
    alone = base.generate(prompt_token_ids=prompts[:1], sampling_params=[wide])[0].token_ids
    for llm in (base, LLM(target, draft=draft, max_num_seqs=4)):
        batched = llm.generate(prompt_token_ids=prompts, sampling_params=[wide, mate])[0].token_ids
        assert batched == alone, (llm.engine.proposer is not None, batched, alone)


@pytest.mark.parametrize("temperature", [float("inf"), 1e50])
def test_a_huge_temperature_never_samples_a_banned_token(temperature):
    """``temperature = inf`` passes SamplingParams' check (and 1e50 is finite): the race must
    still never pick a -inf logit (a stop token min_tokens bans). Before the fix 1 / T rounded
    to 0 in float32, the banned token's score was -inf * 0 = NaN and the argmax (NaN largest)
    picked it at every position; now the kept tokens are drawn near-uniformly (T's limit)."""
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 3] = float("-inf")
    for params, filters in ((SamplingParams(temperature=temperature, seed=1), {}),
                            (SamplingParams(temperature=temperature, seed=1, top_p=0.95, min_p=0.5),
                             {"top_p": 0.95, "min_p": 0.5})):
        picks = torch.cat([sample_rows(logits, [params], [pos]) for pos in range(200)])
        counts = torch.bincount(picks, minlength=10)
        assert counts[3] == 0, counts.tolist()
        assert int((counts > 0).sum()) >= 8, counts.tolist()  # spread over the kept tokens
        probs = filtered_probs(logits, temperature, 0, filters.get("top_p", 1.0), filters.get("min_p", 0.0))
        assert not probs.isnan().any() and probs[0, 3] == 0.0
    # unseeded rows too (the engine generator's noise)
    picks = sample_rows(logits.expand(200, -1), [SamplingParams(temperature=temperature)] * 200,
                        global_generator=torch.Generator().manual_seed(2))
    assert not (picks == 3).any()


def test_min_tokens_holds_at_an_infinite_temperature_with_and_without_dflash(tiny_pair):
    """Engine level: min_tokens bans the stop token before it at ``temperature = inf`` (every
    token about equally likely), with and without speculation. Before the fix the banned stop
    token was sampled first, so each request stopped at its first token."""
    from laguna_dflash import LLM

    target, draft = tiny_pair
    params = [SamplingParams(temperature=float("inf"), min_tokens=6, max_tokens=10, stop_token_ids=[5],
                             seed=s) for s in range(8)]
    for llm in (LLM(target, max_num_seqs=8), LLM(target, draft=draft, max_num_seqs=8)):
        outs = llm.generate(prompt_token_ids=[[3, 14, 15, 9]] * 8, sampling_params=params)
        for out in outs:
            assert len(out.token_ids) >= 6 and 5 not in out.token_ids[:6], out.token_ids
        assert len({tuple(o.token_ids) for o in outs}) == 8  # sampled, not one forced token


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton top-k values path)"))])
@pytest.mark.parametrize("seed", range(4))
def test_every_row_keeps_what_it_keeps_alone_in_random_mixed_batches(monkeypatch, seed, device):
    """Fuzz of the filters' row independence (the property the ranked-columns bug broke): 50
    random batches of 1-6 rows, each row its own temperature, top-k (off, ranked, or above the
    ranked columns), top-p (off or on) and min-p, some logits with ties; every row's kept set
    and probabilities equal those of the row filtered alone, bit for bit."""
    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 8)
    rng = torch.Generator().manual_seed(seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    vocab = 29
    for _ in range(50):
        n = int(torch.randint(1, 7, (1,), generator=rng))
        logits = torch.randn(n, vocab, generator=rng) * pick([0.3, 1.0, 4.0])
        if pick([False, True]):
            logits = logits.round()  # ties at the top-k and top-p boundaries
        logits = logits.to(device)
        temperature = [pick([0.5, 1.0, 1.7]) for _ in range(n)]
        top_k = [pick([0, 1, 3, 8, 12, vocab]) for _ in range(n)]
        top_p = [pick([1.0, 1.0, 0.3, 0.9]) for _ in range(n)]
        min_p = [pick([0.0, 0.0, 0.05]) for _ in range(n)]
        batch = filtered_probs_rows(logits, temperature, top_k, top_p, min_p)
        for i in range(n):
            alone = filtered_probs(logits[i : i + 1], temperature[i], top_k[i], top_p[i], min_p[i])[0]
            assert torch.equal(batch[i], alone), (temperature, top_k, top_p, min_p, i)
