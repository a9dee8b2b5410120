"""Logit bias and presence / frequency / repetition penalties (engine/penalties.py).

Checked against a plain per-position reference (:func:`reference_penalized`, written from the
OpenAI / HF definitions, not from the engine's code): the verify rows' draft-inclusive counts,
target-only greedy decoding step by step, DFlash = target-only token for token, raw logprobs.
The sampled case is in test_spec_sampling.py (the distribution with penalties).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine.penalties import penalized_rows
from laguna_dflash.engine.sequence import Sequence

BLOCK_SIZE = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("penalties"), BLOCK_SIZE)


def reference_penalized(logits: torch.Tensor, prompt: list[int], outputs: list[int],
                        params: SamplingParams) -> torch.Tensor:
    """``logits [V]`` of the position after ``outputs``, biased and penalised one token at a time."""
    z = logits.double().clone()
    for token, bias in (params.logit_bias or {}).items():
        z[token] += bias
    rep = params.repetition_penalty
    for token in set(prompt) | set(outputs):
        z[token] = z[token] / rep if z[token] > 0 else z[token] * rep
    for token, count in Counter(outputs).items():
        z[token] -= params.frequency_penalty * count + params.presence_penalty
    return z


PENALTIES = [
    SamplingParams(temperature=0, presence_penalty=1.5),
    SamplingParams(temperature=0, frequency_penalty=0.7),
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, logit_bias={5: 4.0, 9: -100.0}),
    SamplingParams(temperature=0, presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=0.7,
                   logit_bias={3: 2.0}),
]


@pytest.mark.parametrize("params", PENALTIES + [SamplingParams(temperature=0)])
def test_verify_rows_count_the_drafts_before_them(params):
    """Row j of a request's K + 1 verify rows is penalised as the position after its outputs
    and drafts d_1..d_j; requests without penalties get no rows."""
    g = torch.Generator().manual_seed(0)
    vocab, k = 40, 4
    prompt, outputs = [1, 2, 3, 2, 30], [7, 7, 11, 3]
    seq = Sequence(0, prompt, params, output_token_ids=list(outputs))
    plain = Sequence(1, [4], SamplingParams(temperature=0))
    logits = torch.randn(2 * (k + 1), vocab, generator=g).to(torch.bfloat16)
    drafts = torch.tensor([[7, 12, 7, 1], [0, 0, 0, 0]])
    raw = logits.clone()
    got = penalized_rows(logits, [seq, plain], k + 1, drafts)
    assert torch.equal(logits, raw)  # the raw logits are kept (logprobs)
    if not params.has_penalties:
        assert got == {}
        return
    assert set(got) == {0}
    for j in range(k + 1):
        want = reference_penalized(logits[j].float(), prompt, outputs + drafts[0, :j].tolist(), params)
        torch.testing.assert_close(got[0][j].double(), want, rtol=1e-6, atol=1e-5)
    one = penalized_rows(logits[:1], [seq])[0]  # a decode row: the outputs only
    torch.testing.assert_close(one[0].double(), reference_penalized(logits[0].float(), prompt, outputs, params),
                               rtol=1e-6, atol=1e-5)


def test_min_tokens_bans_the_stop_tokens_of_the_rows_before_it():
    """Rows j < min_tokens - outputs lose EOS (unless ignore_eos) and stop_token_ids; later
    rows, other tokens and ids past the vocabulary are left alone."""
    vocab = 30
    params = SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[9, 500], max_tokens=8)
    seq = Sequence(0, [1, 2], params, eos_token_ids=(3,), output_token_ids=[5, 6])
    logits = torch.randn(4, vocab)
    got = penalized_rows(logits, [seq], 4, torch.tensor([[7, 7, 7]]))[0]
    assert torch.isinf(got[:2, [3, 9]]).all() and (got[:2, [3, 9]] < 0).all()
    keep = [t for t in range(vocab) if t not in (3, 9)]
    assert torch.equal(got[:2, keep], logits[:2, keep]) and torch.equal(got[2:], logits[2:])
    seq.params = replace(params, ignore_eos=True)
    got = penalized_rows(logits, [seq], 4, torch.tensor([[7, 7, 7]]))[0]
    assert torch.isinf(got[:2, 9]).all() and torch.equal(got[:, 3], logits[:, 3])
    seq.output_token_ids = [5, 6, 7, 8]  # min_tokens reached: nothing to do
    assert penalized_rows(logits, [seq], 4, torch.tensor([[7, 7, 7]])) == {}


def test_min_tokens_holds_back_a_stop_token_with_and_without_dflash(pair):
    """A stop token the request would emit first is not emitted before min_tokens; DFlash
    gives target-only's tokens (the verify rows past min_tokens may stop)."""
    target, draft = pair
    prompt = [random.Random(4).randrange(0, 60) for _ in range(10)]
    base = LLM(target, block_size=4)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4)
    free = base.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    stop = free[1]  # the second token: a stop token ends the request right there
    early = base.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop]))[0].token_ids
    assert early == free[:2]
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop], min_tokens=8)
    want = base.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
    got = spec.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
    assert got == want and len(want) >= 8 and stop not in want[:8]
    assert stop not in want[:-1]  # it stops at its first stop token past min_tokens, if any


def test_target_only_greedy_follows_the_reference(pair):
    """Each generated token is the argmax of the reference-penalised logits of the sequence so
    far (full-prompt logits recomputed per token)."""
    target, _ = pair
    llm = LLM(target, block_size=4)
    prompt = [random.Random(1).randrange(0, 60) for _ in range(9)]
    for params in PENALTIES:
        params = replace(params, max_tokens=10, ignore_eos=True)
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
        outputs: list[int] = []
        for _ in range(10):
            logits = llm.engine.prompt_logits(prompt + outputs)[-1]
            outputs.append(int(reference_penalized(logits, prompt, outputs, params).argmax()))
        assert got == outputs, params


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_dflash_with_penalties_equals_target_only(pair, adaptive):
    """Greedy DFlash gives target-only's tokens with every penalty, in a batch where some
    requests have none; the penalties do change the output (the check has teeth)."""
    target, draft = pair
    base = LLM(target, block_size=4, max_num_seqs=8)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=8,
               adaptive_k=adaptive)
    if adaptive:
        spec.engine.k_policy.explore_every = 2  # switch K often
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (5, 12, 8, 20, 3, 9)]
    plist = [replace(p, max_tokens=24, ignore_eos=True) for p in PENALTIES]
    plist.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=plist)]
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=plist)]
    assert got == want
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    unpenalised = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=plain)]
    assert sum(a != b for a, b in zip(want[:-1], unpenalised[:-1])) >= 3
    metrics = spec.get_metrics()  # adaptive K: verify steps and target-only steps mixed
    assert metrics["num_drafts"] > 0 and (adaptive or metrics["num_accepted_tokens"] > 0)


def test_oracle_drafts_are_accepted_with_penalties(pair):
    """Drafts that ARE target-only's next tokens must all be accepted: each verify row j > 0 is
    scored with d_1..d_j already counted (a row that ignored them would pick another token
    whenever a penalty moves the argmax, and the output would part from target-only's)."""
    target, draft = pair
    k = BLOCK_SIZE - 1
    base = LLM(target, block_size=4, max_num_seqs=8)
    spec = LLM(target, draft=draft, num_speculative_tokens=k, block_size=4, max_num_seqs=8)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (6, 11, 4, 15, 8)]
    plist = [replace(p, max_tokens=30, ignore_eos=True) for p in PENALTIES]
    want = {tuple(p): o.token_ids for p, o in
            zip(prompts, base.generate(prompt_token_ids=prompts, sampling_params=plist))}
    proposer = spec.engine.proposer

    def oracle(seqs, k_step=None):
        k_step = k_step or k
        rows = [(want[tuple(s.prompt_token_ids)][len(s.output_token_ids):] + [0] * k_step)[:k_step]
                for s in seqs]
        return torch.tensor(rows)

    proposer.propose = oracle
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=plist)]
    assert got == [want[tuple(p)] for p in prompts]
    metrics = spec.get_metrics()
    # every draft inside the 30 tokens accepted: only the last step's overhang is not
    assert metrics["num_accepted_tokens"] >= metrics["num_draft_tokens"] - len(prompts) * k


def test_logprobs_stay_raw_and_bad_bias_ids_are_refused(pair):
    target, _ = pair
    llm = LLM(target, block_size=4)
    prompt = [5, 17, 22, 5]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0,
                            logit_bias={40: 30.0}, repetition_penalty=2.0)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.token_ids[0] == 40  # the bias wins the argmax
    raw = torch.log_softmax(llm.engine.prompt_logits(prompt)[-1].float(), -1)
    assert out.logprobs[0][40] == pytest.approx(float(raw[40]), abs=1e-4)
    vocab = llm.engine.target.spec.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids \[{vocab}\] are outside"):
        llm.engine.add_request(prompt, SamplingParams(logit_bias={vocab: 1.0}))


@pytest.mark.parametrize("kwargs, needle", [
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),  # 0 * inf: NaN logits
    ({"stop_token_ids": [-1]}, "stop_token_ids"),  # min_tokens would ban token V - 1
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 200.0}}, "logit_bias"),
])
def test_bad_penalties_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_a_batch_is_penalised_as_each_request_alone(monkeypatch):
    """Requests with different penalties, min_tokens and none, in one verify batch: each gets
    bitwise the rows it gets alone, from one pass over all of them (one row gather, not one a
    request)."""
    g = torch.Generator().manual_seed(1)
    vocab, k = 40, 3
    params = PENALTIES + [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=9,
                                                                        stop_token_ids=[4])]
    seqs = [Sequence(i, [1, 2, 3 + i, 2], p, eos_token_ids=(5,), output_token_ids=[7, 3 + i, 7])
            for i, p in enumerate(params)]
    logits = torch.randn(len(seqs) * (k + 1), vocab, generator=g)
    drafts = torch.randint(0, vocab, (len(seqs), k), generator=g)
    calls = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda *a: calls.append(1) or real(*a))
    batch = penalized_rows(logits, seqs, k + 1, drafts)
    assert len(calls) == 1 and set(batch) == set(range(len(seqs))) - {len(PENALTIES)}
    for i, seq in batch.items():
        rows = slice(i * (k + 1), (i + 1) * (k + 1))
        alone = penalized_rows(logits[rows], [seqs[i]], k + 1, drafts[i : i + 1])[0]
        assert torch.equal(seq, alone), params[i]
    # the repetition penalty's prompt mask is made once per request and kept
    assert [s.prompt_mask is not None for s in seqs] == [p.repetition_penalty != 1.0 for p in params]
    assert torch.equal(seqs[2].prompt_mask.nonzero().view(-1), torch.tensor([1, 2, 5]))
