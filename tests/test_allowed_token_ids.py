"""vLLM's ``allowed_token_ids``: only the listed tokens can be generated (engine/penalties.py).

Every other token's logit is -inf at every generated position, before min_tokens, logit_bias and
the penalties. Checked against a per-position reference written from that definition (the
argmax / the distribution over the allowed tokens of the raw logits): the verify's K + 1 rows
all masked, target-only greedy decoding step by step, DFlash = target-only token for token in a
batch with unconstrained requests (theirs unchanged), the sampled distribution under
speculation, raw logprobs, the errors, and a live server.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from test_penalties import reference_penalized

import laguna_dflash.engine.penalties as penalties_module
from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine.penalties import penalized_rows
from laguna_dflash.engine.sampler import filtered_probs
from laguna_dflash.engine.sequence import Sequence

BLOCK_SIZE = 6
VOCAB = 64  # make_tiny_laguna_target's


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("allowed"), BLOCK_SIZE)


def reference_masked(logits: torch.Tensor, prompt: list[int], outputs: list[int],
                     params: SamplingParams) -> torch.Tensor:
    """``logits [V]`` of the position after ``outputs`` (float64): the tokens outside
    ``allowed_token_ids`` at -inf, the others biased and penalised as :func:`reference_penalized`."""
    z = reference_penalized(logits, prompt, outputs, params)
    if params.allowed_token_ids is not None:
        keep = torch.zeros(z.shape[-1], dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        z = z.masked_fill(~keep, float("-inf"))
    return z


def free_greedy(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    return llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def allowed_without(tokens: list[int], size: int, seed: int) -> list[int]:
    """``size`` ids of the vocabulary none of ``tokens`` is among (so the constraint must
    change an output that would be ``tokens``)."""
    rest = [t for t in range(VOCAB) if t not in set(tokens)]
    return sorted(random.Random(seed).sample(rest, size))


# ---- the rows (no model) -------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, allowed_token_ids=[3, 17, 17, 39, 0]),  # a repeated id too
    SamplingParams(temperature=1.0, allowed_token_ids=[5, 9, 12], logit_bias={5: 3.0, 30: 50.0},
                   repetition_penalty=1.7, frequency_penalty=0.8, presence_penalty=-0.4),
    SamplingParams(temperature=0, allowed_token_ids=[7, 8, 9], min_tokens=9, stop_token_ids=[8]),
], ids=["mask-only", "with-penalties", "with-min-tokens"])
def test_every_verify_row_keeps_only_the_allowed_tokens(params):
    """Each of a request's K + 1 verify rows is the reference: the allowed tokens keep their
    (biased, penalised) logits, every other token is -inf, a min_tokens stop token too; the raw
    logits are left alone and a request without a list in the same step keeps every token."""
    g = torch.Generator().manual_seed(0)
    vocab, k = 40, 4
    prompt, outputs = [1, 2, 3, 2, 30], [7, 5, 11, 5]
    seq = Sequence(0, prompt, params, eos_token_ids=(6,), output_token_ids=list(outputs))
    plain = Sequence(1, [4], SamplingParams(temperature=0))
    biased = Sequence(2, [4, 4], SamplingParams(temperature=0, logit_bias={3: 2.0}))  # processed, no list
    logits = torch.randn(3 * (k + 1), vocab, generator=g).to(torch.bfloat16)
    drafts = torch.tensor([[5, 12, 5, 1], [0, 0, 0, 0], [3, 3, 3, 3]])
    raw = logits.clone()
    got = penalized_rows(logits, [seq, plain, biased], k + 1, drafts)
    assert torch.equal(logits, raw) and set(got) == {0, 2}
    allowed = set(params.allowed_token_ids)
    for j in range(k + 1):
        want = reference_masked(logits[j].float(), prompt, outputs + drafts[0, :j].tolist(), params)
        if j < params.min_tokens - len(outputs):
            want[[6, *(params.stop_token_ids or [])]] = float("-inf")
        torch.testing.assert_close(got[0][j].double(), want, rtol=1e-6, atol=1e-5)
        finite = set(torch.isfinite(got[0][j]).nonzero().view(-1).tolist())
        assert finite == allowed - ({8} if j < params.min_tokens - len(outputs) else set())
    assert torch.isfinite(got[2]).all()  # no list: nothing masked beside a masked request


def test_the_mask_is_one_upload_per_step_and_a_batch_gets_each_requests_rows(monkeypatch):
    """All of a step's requests in one int64 upload carrying each list once (not once per
    verify row); every request's rows are bitwise the rows it gets alone."""
    g = torch.Generator().manual_seed(1)
    vocab, k = 50, 3
    params = [SamplingParams(temperature=0, allowed_token_ids=[1, 2, 3]),
              SamplingParams(temperature=0),  # not processed
              SamplingParams(temperature=0.7, allowed_token_ids=list(range(0, vocab, 2))),
              SamplingParams(temperature=0, allowed_token_ids=[49])]
    seqs = [Sequence(i, [1, 2, 3 + i], p, output_token_ids=[7, 3 + i]) for i, p in enumerate(params)]
    logits = torch.randn(len(seqs) * (k + 1), vocab, generator=g)
    drafts = torch.randint(0, vocab, (len(seqs), k), generator=g)
    uploads = []
    real = penalties_module.to_device_async
    monkeypatch.setattr(penalties_module, "to_device_async", lambda t, d: uploads.append(t) or real(t, d))
    batch = penalized_rows(logits, seqs, k + 1, drafts)
    assert len(uploads) == 1 and set(batch) == {0, 2, 3}
    # the row gather's 3 * (k + 1) ids, the three lists once each, the 3 output counts
    assert uploads[0].numel() == 3 * (k + 1) + 3 + vocab // 2 + 1 + 3
    assert torch.equal(batch[3], torch.where(torch.arange(vocab) == 49, logits[3 * (k + 1):], float("-inf")))
    for i, rows in batch.items():
        alone = penalized_rows(logits[i * (k + 1) : (i + 1) * (k + 1)], [seqs[i]], k + 1, drafts[i : i + 1])[0]
        assert torch.equal(rows, alone), i


# ---- the engine ----------------------------------------------------------------------------------


def test_greedy_follows_the_masked_reference_and_changes_the_output(pair):
    """Target-only greedy: each token is the argmax over the allowed tokens of the raw logits
    of the sequence so far (penalties on top where asked); the unconstrained output is not
    reachable, so the constraint changes it (the check has teeth)."""
    target, _ = pair
    llm = LLM(target, block_size=4)
    prompt = [random.Random(1).randrange(0, 60) for _ in range(9)]
    free = free_greedy(llm, prompt, 10)
    allowed = allowed_without(free, 6, seed=0)
    for params in (SamplingParams(temperature=0, allowed_token_ids=allowed),
                   SamplingParams(temperature=0, allowed_token_ids=allowed, repetition_penalty=1.8,
                                  logit_bias={allowed[0]: -3.0, free[0]: 100.0})):
        params = replace(params, max_tokens=10, ignore_eos=True)
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
        outputs: list[int] = []
        for _ in range(10):
            logits = llm.engine.prompt_logits(prompt + outputs)[-1]
            outputs.append(int(reference_masked(logits, prompt, outputs, params).argmax()))
        assert got == outputs and set(got) <= set(allowed) and got != free, params


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_dflash_equals_target_only_in_a_mixed_batch(pair, adaptive):
    """Greedy DFlash gives target-only's tokens for requests with allowed_token_ids (with and
    without penalties), batched with requests without it, whose output is the one they get
    alone; sampled requests stay in their sets under speculation, several seeds."""
    target, draft = pair
    base = LLM(target, block_size=4, max_num_seqs=8)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=8,
               adaptive_k=adaptive)
    if adaptive:
        spec.engine.k_policy.explore_every = 2  # switch K often
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (5, 12, 8, 20, 3, 9)]
    free = [free_greedy(base, p, 24) for p in prompts]  # each alone
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plist = [replace(greedy, allowed_token_ids=allowed_without(free[0], 3, seed=1)),
             greedy,
             replace(greedy, allowed_token_ids=allowed_without(free[2], 20, seed=2), frequency_penalty=0.5),
             replace(greedy, allowed_token_ids=allowed_without(free[3][:1], VOCAB - 1, seed=3)),
             greedy,
             replace(greedy, allowed_token_ids=[free[5][0], (free[5][0] + 1) % VOCAB])]
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=plist)]
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=plist)]
    assert got == want
    for i, p in enumerate(plist):
        if p.allowed_token_ids is None:
            assert got[i] == free[i]  # unchanged by its batch mates' lists
        else:
            assert set(got[i]) <= set(p.allowed_token_ids) and got[i] != free[i], i
    metrics = spec.get_metrics()  # adaptive K: verify steps and target-only steps mixed
    assert metrics["num_drafts"] > 0 and (adaptive or metrics["num_accepted_tokens"] > 0)
    allowed = allowed_without(free[0][:3], 5, seed=4)
    for temperature, top_k in ((1.0, 0), (1.5, 3), (0.8, 20)):
        sampled = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=12, ignore_eos=True,
                                  seed=seed, allowed_token_ids=allowed) for seed in range(6)]
        for llm in (base, spec):
            outs = llm.generate(prompt_token_ids=[prompts[i % 6] for i in range(6)], sampling_params=sampled)
            tokens = {t for o in outs for t in o.token_ids}
            assert tokens <= set(allowed) and len(tokens) >= 2, (temperature, tokens)


def test_oracle_drafts_are_all_accepted(pair):
    """Drafts that ARE target-only's constrained tokens are all accepted: every verify row j
    is masked (a row scored unmasked would pick the unconstrained argmax, reject the draft and
    commit a token outside the set)."""
    target, draft = pair
    k = BLOCK_SIZE - 1
    base = LLM(target, block_size=4, max_num_seqs=8)
    spec = LLM(target, draft=draft, num_speculative_tokens=k, block_size=4, max_num_seqs=8)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (6, 11, 4, 15)]
    plist = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            allowed_token_ids=allowed_without(free_greedy(base, p, 30), 4, seed=i))
             for i, p in enumerate(prompts)]
    want = {tuple(p): o.token_ids for p, o in
            zip(prompts, base.generate(prompt_token_ids=prompts, sampling_params=plist))}

    def oracle(seqs, k_step=None):
        k_step = k_step or k
        return torch.tensor([(want[tuple(s.prompt_token_ids)][len(s.output_token_ids):] + [0] * k_step)[:k_step]
                             for s in seqs])

    spec.engine.proposer.propose = oracle
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=plist)]
    assert got == [want[tuple(p)] for p in prompts]
    metrics = spec.get_metrics()
    assert metrics["num_accepted_tokens"] >= metrics["num_draft_tokens"] - len(prompts) * k


def test_logprobs_stay_raw(pair):
    """The logprobs are the model's raw ones (log_softmax of the unmasked logits), with and
    without a drafter: the chosen token's and the top ones', which lie outside the set."""
    target, draft = pair
    prompt = [5, 17, 22, 5, 40]
    base = LLM(target, block_size=4)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4)
    free = free_greedy(base, prompt, 6)
    allowed = allowed_without(free, 3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, allowed_token_ids=allowed)
    for llm in (base, spec):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        for n, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            raw = torch.log_softmax(base.engine.prompt_logits(prompt + out.token_ids[:n])[-1].double(), -1)
            assert token in allowed and entry[token] == pytest.approx(float(raw[token]), abs=1e-4)
            top = raw.topk(2).indices.tolist()
            assert all(t in entry and entry[t] == pytest.approx(float(raw[t]), abs=1e-4) for t in top)
        assert free[0] in out.logprobs[0] and free[0] not in allowed  # a token it could not pick


# ---- the sampled distribution under speculation ---------------------------------------------------

PROMPT = [3, 14, 15, 9, 2, 6]
NUM_SAMPLES = 1200


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_small_vocab_pair(tmp_path_factory.mktemp("allowed_sampling"))


def exact_third_token(llm: LLM, params: SamplingParams) -> np.ndarray:
    """``p(t3)``, the third token's exact marginal (the first tokens the verify scores at rows
    past its first), over every allowed prefix: the raw logits masked, then the sampler's
    filters."""

    def probs(ids: list[int]) -> torch.Tensor:
        z = reference_masked(llm.engine.prompt_logits(ids)[-1], PROMPT, ids[len(PROMPT):], params)
        return filtered_probs(z[None].float(), params.temperature, params.top_k, params.top_p,
                              params.min_p)[0].double()

    p1, p3 = probs(PROMPT), 0.0
    for t1 in p1.nonzero().view(-1).tolist():
        q2 = probs(PROMPT + [t1])
        for t2 in q2.nonzero().view(-1).tolist():
            p3 = p3 + p1[t1] * q2[t2] * probs(PROMPT + [t1, t2])
    return p3.numpy()


def test_spec_sampling_keeps_the_masked_distribution(small_vocab_pair):
    """Temperature 1 with allowed_token_ids: the third token's samples follow the exact masked
    marginal with and without speculation (chi-square), and never leave the set; the masked
    marginal differs from the unmasked one (the check has teeth)."""
    target, draft = small_vocab_pair
    allowed = [1, 4, 6, 9, 12, 15, 19, 22]
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed, presence_penalty=0.5)
    base = LLM(target, max_num_seqs=128)
    p3 = exact_third_token(base, params)
    unmasked = exact_third_token(base, replace(params, allowed_token_ids=None))
    assert (p3 > 0.02).sum() >= 3 and p3.sum() == pytest.approx(1.0)
    assert p3[[t for t in range(24) if t not in allowed]].sum() == 0
    assert unmasked[[t for t in range(24) if t not in allowed]].sum() > 0.1
    spec = LLM(target, draft=draft, max_num_seqs=128)
    for llm in (base, spec):
        plist = [replace(params, max_tokens=3, ignore_eos=True, seed=1000 + i) for i in range(NUM_SAMPLES)]
        tokens = np.array([o.token_ids for o in llm.generate(prompt_token_ids=[PROMPT] * NUM_SAMPLES,
                                                             sampling_params=plist)])
        assert set(tokens.flatten().tolist()) <= set(allowed)
        counts = np.bincount(tokens[:, 2], minlength=24)[allowed].astype(float)
        expected = p3[allowed] * NUM_SAMPLES
        big = expected >= 5
        obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        p_value = chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
        assert p_value > 1e-3, (llm.engine.proposer is not None, p_value)
    assert spec.get_metrics()["num_accepted_tokens"] > 0


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, needle", [
    ([], "non-empty list"),
    (5, "non-empty list"),
    ("1,2", "non-empty list"),
    ([3, -1], r"ints >= 0\), got \[-1\]"),
    ([1, 2.0], "ints >= 0"),
    ([True], "ints >= 0"),
])
def test_bad_lists_are_refused_naming_the_field(value, needle):
    with pytest.raises(ValueError, match=rf"SamplingParams\.allowed_token_ids .*{needle}"):
        SamplingParams(allowed_token_ids=value)


def test_a_tuple_and_numpy_ids_are_taken_as_a_list():
    params = SamplingParams(allowed_token_ids=(np.int64(3), 4))
    assert params.allowed_token_ids == [3, 4] and type(params.allowed_token_ids[0]) is int
    assert params.has_penalties and not SamplingParams().has_penalties


def test_the_engine_refuses_ids_past_the_vocabulary_and_a_list_min_tokens_bans(pair):
    target, _ = pair
    engine = LLM(target, block_size=4).engine
    with pytest.raises(ValueError, match=rf"allowed_token_ids token ids \[{VOCAB}, {VOCAB + 5}\] are outside "
                                         rf"the vocabulary \[0, {VOCAB}\)"):
        engine.add_request([1, 2], SamplingParams(allowed_token_ids=[3, VOCAB, VOCAB + 5]))
    with pytest.raises(ValueError, match="allowed_token_ids .* are all stop tokens .* min_tokens=2"):
        engine.add_request([1, 2], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2))
    # with another token allowed, or past min_tokens' reach, the request is taken
    engine.add_request([1, 2], SamplingParams(allowed_token_ids=[7, 8], stop_token_ids=[7], min_tokens=2))
    engine.add_request([1, 2], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7]))


def test_request_fields_reach_sampling_params_and_bad_ones_are_400s():
    from laguna_dflash.server.errors import APIError
    from laguna_dflash.server.protocol import ChatCompletionRequest, CompletionRequest
    from laguna_dflash.server.sampling import build_sampling_params, reject_unsupported

    for req in (CompletionRequest(prompt="x", allowed_token_ids=[4, 2]),
                ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], allowed_token_ids=[4, 2])):
        reject_unsupported(req)  # no longer a "not supported"
        assert build_sampling_params(req, 4, None, {}).allowed_token_ids == [4, 2]
    assert build_sampling_params(CompletionRequest(prompt="x"), 4, None, {}).allowed_token_ids is None
    for bad in ([], [1, -3]):
        with pytest.raises(APIError) as info:
            build_sampling_params(CompletionRequest(prompt="x", allowed_token_ids=bad), 4, None, {})
        assert info.value.status == 400 and info.value.param == "allowed_token_ids", bad


# ---- a live server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """A target-only server (vocabulary 64, no tokenizer: token-id prompts) and its target."""
    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path_factory.mktemp("allowed_bare") / "target", seed=0)
    with df.tiny_http_server(target, "--max-model-len", "64") as http:
        yield http, target


def test_completions_honour_allowed_token_ids_over_http(bare_server):
    """Greedy: offline's constrained tokens (not the unconstrained ones), streamed or not;
    sampled choices stay in the set; the logprobs are raw (the top one lies outside it)."""
    http, target = bare_server
    prompt = [3, 1, 4, 1, 5]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    allowed = allowed_without(free, 4, seed=6)
    offline = LLM(target, block_size=8).generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed))[0].token_ids
    r = http.post("/v1/completions", json={**body, "allowed_token_ids": allowed, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == offline and set(offline) <= set(allowed) and offline != free
    top = choice["logprobs"]["top_logprobs"][0]
    assert f"token_id:{free[0]}" in top  # the raw top token, which the set excludes
    streamed = http.post("/v1/completions", json={**body, "allowed_token_ids": allowed, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == offline
    sampled = http.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 7, "n": 4,
                                                 "allowed_token_ids": allowed})
    assert sampled.status_code == 200, sampled.text
    tokens = {t for c in sampled.json()["choices"] for t in c["token_ids"]}
    assert tokens <= set(allowed) and len(tokens) >= 2


@pytest.mark.parametrize("value, needle", [
    ([3, VOCAB], f"outside the vocabulary [0, {VOCAB})"),
    ([3, -1], "token ids >= 0"),
    ([], "non-empty list"),
    ("3", "allowed_token_ids"),
])
def test_bad_allowed_token_ids_are_a_400_and_the_server_goes_on(bare_server, value, needle):
    http, _ = bare_server
    body = {"prompt": [3, 1, 4], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    for extra in ({}, {"stream": True}, {"n": 2}):
        r = http.post("/v1/completions", json={**body, **extra, "allowed_token_ids": value})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == "allowed_token_ids" and needle in error["message"], error
    ok = http.post("/v1/completions", json={**body, "allowed_token_ids": [9]})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
