"""Step edge cases of speculative decoding, each against target-only decoding (or a hand-made
expectation): requests ending inside an accepted block (max_tokens, stop ids, EOS as the bonus
token, max_model_len), min_tokens with stop tokens planted in the drafts, aborts between steps,
preemption, mixed greedy / sampled batches, one-token prompts and max_tokens = 1.

CPU, float32, a tiny Laguna target with a random-weight Poolside drafter: it shares the target's
embeddings and lm_head, so some drafts are accepted (the tests that need blocks ending in
accepted drafts assert they met some), most are corrected.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from laguna_dflash import LLM, SamplingParams

BLOCK_SIZE = 6
K = BLOCK_SIZE - 1


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("edges"), BLOCK_SIZE)


@pytest.fixture(scope="module")
def base(pair):
    return LLM(pair[0], block_size=4, max_num_seqs=8)


@pytest.fixture(scope="module")
def spec(pair):
    return LLM(pair[0], draft=pair[1], num_speculative_tokens=K, block_size=4, max_num_seqs=8, trace=True)


def _prompts(n: int, seed: int, lengths=(1, 7, 13, 3, 22, 9, 2, 17)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 60) for _ in range(length)] for length in lengths[:n]]


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _emitted_in_blocks(trace: list[dict]) -> list[tuple[int, int]]:
    """``(output index, index inside its step's emitted tokens)`` of every token a DFlash step
    emitted (the prefill's first token is output 0 and not in the trace)."""
    out, n = [], 1
    for step in trace:
        for j in range(step["num_accepted"] + 1):
            out.append((n, j))
            n += 1
    return out


def _assert_blocks_back(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "KV blocks leaked"


def test_max_tokens_inside_an_accepted_block(base, spec):
    """Every max_tokens from 1 to 16: the same tokens as target-only, exactly max_tokens of
    them, reason "length", one logprob entry per token; some runs end inside a block whose
    drafts were accepted (the cut falls on an accepted draft, not on the block's last token)."""
    prompts = _prompts(8, seed=1)
    full = spec.generate(prompt_token_ids=prompts, sampling_params=_greedy(24))
    cut_inside = 0
    for n in range(1, 17):
        params = _greedy(n, logprobs=2)
        want = base.generate(prompt_token_ids=prompts, sampling_params=params)
        got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
        for g, w, f in zip(got, want, full):
            assert g.token_ids == w.token_ids, n
            assert len(g.token_ids) == n and g.finish_reason == "length"
            assert g.logprobs is not None and len(g.logprobs) == n
            assert all(t in d for t, d in zip(g.token_ids, g.logprobs))
            run = _emitted_in_blocks(f.metrics["trace"])
            # output n - 1 (the last kept) and output n came out of the same step
            cut_inside += any(a == n - 1 and b == n and jb > 0
                              for (a, _), (b, jb) in zip(run, run[1:]))
    assert cut_inside > 0, "no run ended inside a block: the test has no teeth"
    _assert_blocks_back(spec)


def test_stop_ids_and_eos_inside_and_at_the_end_of_blocks(pair, base, spec):
    """Stop token ids that first appear as an accepted draft (inside a block) and as a step's
    bonus / correction token (the block's last): target-only's tokens, the stop token last,
    reason "stop"."""
    prompts = _prompts(8, seed=2)
    full = spec.generate(prompt_token_ids=prompts, sampling_params=_greedy(30))
    want_full = base.generate(prompt_token_ids=prompts, sampling_params=_greedy(30))
    assert [o.token_ids for o in full] == [o.token_ids for o in want_full]
    kinds = set()
    for i, f in enumerate(full):
        run = _emitted_in_blocks(f.metrics["trace"])
        last_of_step = {idx for idx in range(len(run))
                        if idx + 1 == len(run) or run[idx + 1][1] == 0}
        for idx, (n, _) in enumerate(run):
            tok = f.token_ids[n]
            if tok in f.token_ids[:n] or n < 2:
                continue
            kind = "bonus" if idx in last_of_step else "draft"
            if kind in kinds:
                continue
            kinds.add(kind)
            params = _greedy(30, stop_token_ids=[tok])
            got = spec.generate(prompt_token_ids=[prompts[i]], sampling_params=params)[0]
            want = base.generate(prompt_token_ids=[prompts[i]], sampling_params=params)[0]
            assert got.token_ids == want.token_ids == f.token_ids[: n + 1], (kind, n)
            assert got.finish_reason == want.finish_reason == "stop"
    assert kinds == {"bonus", "draft"}, kinds
    _assert_blocks_back(spec)


def test_eos_from_the_config_as_a_draft_and_as_the_bonus_token(pair, tmp_path):
    """``eos_token_id`` of config.json (a list: one token first emitted as an accepted draft,
    one as a step's last token): DFlash stops where target-only stops, EOS included, reason
    "stop"; with ignore_eos both run to max_tokens."""
    import json
    import shutil

    target, draft = pair
    prompts = _prompts(8, seed=2)
    spec = LLM(target, draft=draft, num_speculative_tokens=K, block_size=4, trace=True)
    full = spec.generate(prompt_token_ids=prompts, sampling_params=_greedy(30))
    picked = {}
    for i, f in enumerate(full):
        run = _emitted_in_blocks(f.metrics["trace"])
        for idx, (n, _) in enumerate(run):
            kind = "bonus" if idx + 1 == len(run) or run[idx + 1][1] == 0 else "draft"
            if kind not in picked and n >= 2 and f.token_ids[n] not in f.token_ids[:n]:
                picked[kind] = (i, n, f.token_ids[n])
    assert set(picked) == {"bonus", "draft"}, picked
    eos_target = tmp_path / "eos"
    shutil.copytree(target, eos_target)
    config = json.loads((eos_target / "config.json").read_text())
    config["eos_token_id"] = [t for _, _, t in picked.values()]
    (eos_target / "config.json").write_text(json.dumps(config))
    eos_base = LLM(eos_target, block_size=4)
    eos_spec = LLM(eos_target, draft=draft, num_speculative_tokens=K, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=30)
    for i, n, _ in picked.values():
        got = eos_spec.generate(prompt_token_ids=[prompts[i]], sampling_params=params)[0]
        want = eos_base.generate(prompt_token_ids=[prompts[i]], sampling_params=params)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
        assert len(got.token_ids) <= n + 1 and got.token_ids[-1] in config["eos_token_id"]
    ignore = [o.token_ids for o in eos_spec.generate(prompt_token_ids=prompts, sampling_params=_greedy(30))]
    assert ignore == [o.token_ids for o in full]
    _assert_blocks_back(eos_spec)


def test_min_tokens_with_stop_tokens_planted_in_the_drafts(pair, base):
    """A drafter proposing the stop token at every other draft slot: the verify must not emit it before
    min_tokens (rows banned), and the tokens equal target-only's with the same min_tokens."""
    target, draft = pair
    prompts = _prompts(4, seed=3)
    free = base.generate(prompt_token_ids=prompts, sampling_params=_greedy(24))
    stop = free[0].token_ids[2]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], min_tokens=10)
    want = base.generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(target, draft=draft, num_speculative_tokens=K, block_size=4)
    eng = llm.engine
    propose = eng.proposer.propose

    def stop_drafts(seqs, k=None):
        d = propose(seqs, k).clone()
        d[:, ::2] = stop
        return d

    eng.proposer.propose = stop_drafts
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for o in got:
        assert stop not in o.token_ids[:10]
    assert stop in want[0].token_ids[10:] or len(want[0].token_ids) == 24
    _assert_blocks_back(llm)


@pytest.mark.parametrize("max_model_len", [24, 27, 30])
def test_max_model_len_reached_inside_a_verify(pair, max_model_len):
    """Requests reaching max_model_len in the middle of a verified block stop exactly there,
    with target-only's tokens and reason "length"."""
    target, draft = pair
    prompts = _prompts(8, seed=4)
    params = _greedy(40)
    want = LLM(target, block_size=4, max_model_len=max_model_len).generate(
        prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(target, draft=draft, block_size=4, max_model_len=max_model_len)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o, p in zip(got, prompts):
        assert len(p) + len(o.token_ids) == max_model_len and o.finish_reason == "length"
    _assert_blocks_back(llm)


def test_abort_between_steps_keeps_the_others(pair, base):
    """Aborting requests between DFlash steps (a running one, a waiting one, one already
    finished) leaves the other requests' tokens equal to target-only's and frees every block;
    requests added later still match."""
    target, draft = pair
    prompts = _prompts(6, seed=5)
    params = [_greedy(20)] * 3 + [_greedy(3)] + [_greedy(20)] * 2
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(target, draft=draft, num_speculative_tokens=K, block_size=4, max_num_seqs=4)
    eng = llm.engine
    seqs = [eng.add_request(p, q) for p, q in zip(prompts, params)]
    for _ in range(3):
        eng.step()
    assert seqs[3].is_finished
    eng.abort(seqs[3])  # finished: a no-op
    eng.abort(seqs[1])  # running
    eng.abort(seqs[5])  # still waiting (max_num_seqs=4)
    assert seqs[1].finish_reason == "abort" and seqs[3].finish_reason == "length"
    while eng.has_unfinished:
        eng.step()
    for i in (0, 2, 3, 4):
        assert seqs[i].output_token_ids == want[i], i
    assert want[1][: len(seqs[1].output_token_ids)] == seqs[1].output_token_ids
    assert seqs[5].output_token_ids == []
    _assert_blocks_back(llm)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in again] == want
    _assert_blocks_back(llm)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_preemption_with_mixed_greedy_and_sampled_requests(pair, base, adaptive):
    """KV pressure: requests are preempted and recomputed. Greedy requests give target-only's
    tokens in a batch also holding sampled ones, stop ids and small max_tokens; blocks come back."""
    target, draft = pair
    prompts = _prompts(8, seed=6)
    greedy = [_greedy(28), _greedy(5), _greedy(28, logprobs=1), _greedy(1)]
    sampled = SamplingParams(temperature=0.9, max_tokens=28, ignore_eos=True, seed=11)
    params = [greedy[0], sampled, greedy[1], greedy[2], replace(sampled, seed=12), greedy[3],
              greedy[0], replace(sampled, seed=None)]
    want = base.generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(target, draft=draft, num_speculative_tokens=K, block_size=4, num_kv_blocks=36,
              max_model_len=64, adaptive_k=adaptive)
    if adaptive:
        llm.engine.k_policy.explore_every = 2
    preempted = []
    preempt = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda s: (preempted.append(s.request_id), preempt(s))[1]
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert preempted, "no preemption: the test did not create KV pressure"
    for g, w, p in zip(got, want, params):
        assert len(g.token_ids) == p.max_tokens
        if p.is_greedy:
            assert g.token_ids == w.token_ids
    assert got[3].logprobs is not None and len(got[3].logprobs) == 28
    _assert_blocks_back(llm)


def test_one_token_prompts_and_one_token_outputs(pair, base, spec):
    """Prompts of one token, max_tokens = 1 and 2 (the second token is the first verify's)."""
    prompts = [[7], [0], [59], [3, 4]]
    for n in (1, 2, 3, 7):
        params = _greedy(n)
        want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
        got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want and all(len(t) == n for t in got)
    _assert_blocks_back(spec)


def test_seeded_sampling_is_reproducible_with_dflash(pair, spec):
    """The same seed gives the same tokens across calls and batch positions with DFlash
    (``n`` choices with seeds), and different seeds differ."""
    prompt = _prompts(1, seed=7, lengths=(15,))[0]
    params = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=s) for s in (1, 2, 1, 3)]
    first = [o.token_ids for o in spec.generate(prompt_token_ids=[prompt] * 4, sampling_params=params)]
    assert first[0] == first[2] and first[0] != first[1]
    alone = spec.generate(prompt_token_ids=[prompt], sampling_params=params[0])[0].token_ids
    assert alone == first[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=123),
    SamplingParams(temperature=1.2, top_k=6, max_tokens=30, ignore_eos=True, seed=7, presence_penalty=0.4),
], ids=["t0.8", "t1.2-topk-penalty"])
def test_seeded_tokens_do_not_depend_on_k_acceptance_or_preemption(pair, base, params):
    """A seeded request's tokens depend on its prompt, params and seed only: each output
    position's noise is a function of (seed, position), whatever K (adaptive K picks it from step
    timings), the acceptance and preemption, so DFlash at any K, adaptive K and a preempted and
    recomputed request all give target-only's seeded tokens (greedy requests around it too)."""
    target, draft = pair
    prompts = _prompts(8, seed=9)
    J = 7
    want = base.generate(prompt_token_ids=[prompts[J]], sampling_params=params)[0].token_ids
    assert want != base.generate(prompt_token_ids=[prompts[J]], sampling_params=_greedy(30))[0].token_ids
    accepted = 0
    for k in (K, 2, 1):
        llm = LLM(target, draft=draft, num_speculative_tokens=k, block_size=4)
        assert llm.generate(prompt_token_ids=[prompts[J]], sampling_params=params)[0].token_ids == want, k
        accepted += llm.get_metrics()["num_accepted_tokens"]
    assert accepted > 0
    # adaptive K: the choice follows wall-clock step times; here a fixed irregular pattern
    llm = LLM(target, draft=draft, num_speculative_tokens=K, block_size=4, adaptive_k=True)
    pattern = iter([K, 0, 3, 1, 0, 0, 2, K, 4] * 10)
    llm.engine.k_policy.choose = lambda batch_size: next(pattern)
    assert llm.generate(prompt_token_ids=[prompts[J]], sampling_params=params)[0].token_ids == want
    # KV pressure: the seeded request is preempted and recomputed among greedy requests
    llm = LLM(target, draft=draft, num_speculative_tokens=K, block_size=4, num_kv_blocks=30,
              max_num_batched_tokens=16, max_model_len=64)
    preempted = []
    preempt = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda s: (preempted.append(s.request_id), preempt(s))[1]
    plist = [_greedy(30)] * J + [params]  # the last admitted: preempted first
    got = llm.generate(prompt_token_ids=prompts, sampling_params=plist)
    assert preempted.count(J) > 0, preempted
    assert got[J].token_ids == want
    greedy_want = base.generate(prompt_token_ids=prompts, sampling_params=plist)
    assert [o.token_ids for i, o in enumerate(got) if i != J] == \
        [o.token_ids for i, o in enumerate(greedy_want) if i != J]
    _assert_blocks_back(llm)


def test_seeded_verify_rows_take_the_positions_decode_would(pair, base, monkeypatch):
    """Seeded DFlash at K = 3 gives target-only's tokens, token for token, for a batch of seeded
    requests of different lengths (float32): a verify's row j samples with the noise of output
    position len(output) + j, the one target-only decode uses there. The check is sharp: verify
    rows shifted one position (the off-by-one this guards against) give other tokens."""
    import laguna_dflash.engine.engine as engine_mod

    target, draft = pair
    prompts = _prompts(4, seed=10)
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=s) for s in (21, 22, 23, 24)]
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    real = engine_mod.sample_rows

    def shifted(logits, params, positions=None, rows_per_request=1, **kw):
        if rows_per_request > 1:  # verify rows only
            positions = [p + 1 for p in positions]
        return real(logits, params, positions, rows_per_request, **kw)

    monkeypatch.setattr(engine_mod, "sample_rows", shifted)
    llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4)
    off = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert off != want
    assert [o[0] for o in off] == [w[0] for w in want]  # the prefill's first token is unshifted


@pytest.mark.parametrize("options", [
    {"block_size": 1},
    {"block_size": 7},
    {"block_size": 4, "max_num_seqs": 1},
    {"block_size": 4, "max_num_batched_tokens": 5},
    {"block_size": 3, "max_num_batched_tokens": 8, "num_kv_blocks": 40, "max_model_len": 48},
], ids=["block1", "block7", "one-seq", "chunks-of-5", "chunks-and-pressure"])
def test_scheduler_limits_with_dflash(pair, base, options):
    """Block sizes that do not divide K + 1, one sequence slot, prompts chunked over many steps
    (with KV pressure): target-only's tokens for requests of mixed lengths and max_tokens."""
    target, draft = pair
    prompts = _prompts(8, seed=8)
    params = [_greedy(n) for n in (1, 2, 30, 6, 17, 1, 25, 9)]
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(target, draft=draft, num_speculative_tokens=K, **options)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    _assert_blocks_back(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_tokens_do_not_depend_on_k_on_cuda(pair):
    """The same on a GPU with CUDA graphs: the counter-noise kernel, one noise per output
    position. float32: the verify and decode logits agree to ~1e-6, far from moving an
    exponential race."""
    target, draft = pair
    prompts = _prompts(4, seed=9)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=s)
              for s in (5, 6, 7, 8)]
    base = LLM(target, device="cuda", block_size=4)
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
    for k in (K, 2):
        llm = LLM(target, draft=draft, device="cuda", num_speculative_tokens=k, block_size=4)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, k
        assert llm.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("kwargs, error, needle", [
    ({}, ValueError, "exactly one of prompts="),
    ({"prompts": ["x"], "prompt_token_ids": [[1]]}, ValueError, "exactly one of prompts="),
    ({"prompts": 3}, ValueError, "pass token ids as prompt_token_ids="),
    ({"prompts": [5, 6]}, ValueError, "pass token ids as prompt_token_ids="),
    ({"prompts": [["a"]]}, ValueError, "a prompt must be a string"),
    ({"prompt_token_ids": "12"}, ValueError, "pass text as prompts="),
    ({"prompt_token_ids": [[1], [2]], "sampling_params": [SamplingParams()] * 3}, ValueError,
     "3 sampling_params for 2 prompts"),
    ({"prompt_token_ids": [[1]], "sampling_params": {"max_tokens": 3}}, TypeError,
     "sampling_params must be a SamplingParams"),
])
def test_bad_generate_arguments_are_clear_errors(base, kwargs, error, needle):
    """``LLM.generate`` refuses malformed arguments with a message that says what to pass, and
    the engine is left as it was."""
    with pytest.raises(error, match=needle):
        base.generate(**kwargs)
    _assert_blocks_back(base)
    assert len(base.generate(prompt_token_ids=[[1, 2]], sampling_params=_greedy(2))[0].token_ids) == 2
