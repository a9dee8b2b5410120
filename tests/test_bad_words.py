"""vLLM's ``bad_words``: words the output never contains (config.tokenize_bad_words,
engine/penalties.py).

A word's token sequences (``word.lstrip()``, and ``" " + word.lstrip()`` when as long with another
first token) are banned in the OUTPUT: at a position whose preceding outputs end with
``w_1 .. w_{m-1}``, ``w_m``'s logit is -inf (a one-token word everywhere). Checked against a
per-row reference written from that definition: the tokenization on the demo tokenizer, the
verify's K + 1 rows with drafts completing a word mid-block, target-only greedy step by step,
DFlash = target-only token for token in a mixed batch, seeded sampling (unchanged up to the
first banned token, never a banned sequence), raw logprobs, the errors, and live servers with
and without a tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_allowed_token_ids import reference_masked

import laguna_dflash.engine.penalties as penalties_module
from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import tokenize_bad_words
from laguna_dflash.engine.penalties import penalized_rows
from laguna_dflash.engine.sequence import Sequence

BLOCK_SIZE = 6
VOCAB = 64  # make_tiny_laguna_target's
DEMO_TARGET = Path(__file__).resolve().parents[1] / "assets" / "demo" / "target"
DEMO_DRAFT = DEMO_TARGET.parent / "draft"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("bad_words"), BLOCK_SIZE)


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TARGET))


def banned_after(past: list[int], words) -> set[int]:
    """The tokens the bad ``words`` ban at the position after ``past`` (the outputs so far): a
    word's last token where the word's other tokens are the last of ``past``."""
    out = set()
    for w in words:
        prefix = list(w[:-1])
        if len(prefix) <= len(past) and past[len(past) - len(prefix):] == prefix:
            out.add(w[-1])
    return out


def reference_rows(logits: torch.Tensor, prompt: list[int], past: list[int],
                   params: SamplingParams) -> torch.Tensor:
    """``logits [V]`` after ``past`` (float64): allowed / biased / penalised as
    :func:`reference_masked`, the bad words' banned tokens -inf."""
    z = reference_masked(logits, prompt, past, params)
    z[sorted(banned_after(past, params.bad_words_token_ids or ()))] = float("-inf")
    return z


def occurs(words, tokens: list[int]) -> list[tuple[int, ...]]:
    """The ``words`` found as contiguous runs of ``tokens``."""
    return [tuple(w) for w in words
            if any(tokens[s : s + len(w)] == list(w) for s in range(len(tokens) - len(w) + 1))]


def free_greedy(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    return llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def first_at(tokens: list[int], word: tuple[int, ...]) -> int:
    """Where ``word`` first ends in ``tokens`` (the index of its last token)."""
    return next(s + len(word) - 1 for s in range(len(tokens)) if tuple(tokens[s : s + len(word)]) == word)


# ---- tokenization ---------------------------------------------------------------------------------


def test_tokenization_follows_vllms_rule_on_the_demo_tokenizer(demo_tokenizer):
    """Each word: its lstripped ids, then the spaced ids when as many with another first token."""
    tok = demo_tokenizer

    def enc(text):
        return tuple(tok.encode(text, add_special_tokens=False))

    # "def" / " def" are two single tokens; "hello world" gains a token after a space (dropped);
    # "import numpy" keeps its length with another first token; "  return" is lstripped first
    words = ["def", "hello world", "import numpy", "  return"]
    got = tokenize_bad_words(tok, words)
    assert enc("def") == (497,) and enc(" def") == (333,)  # the demo tokenizer's ids
    assert len(enc(" hello world")) == len(enc("hello world")) + 1
    want = [enc("def"), enc(" def"), enc("hello world"), enc("import numpy"), enc(" import numpy"),
            enc("return"), enc(" return")]
    assert list(got) == want and len(set(want)) == 7
    assert enc("import numpy")[1:] == enc(" import numpy")[1:]
    # the same word twice, or a spelling that gives the same ids, bans once
    assert tokenize_bad_words(tok, ["def", " def", "def"]) == ((497,), (333,))
    # LLM.generate's ids are these (one implementation): the tokenizer LLM loads
    llm = LLM(str(DEMO_TARGET), load_format="dummy", max_model_len=64, num_kv_blocks=8)
    params = llm._with_bad_words_ids([SamplingParams(bad_words=words)])[0]
    assert params.bad_words_token_ids == got and params.has_penalties


class _StubTokenizer:
    """Fixed encodings: ``" ab"`` keeps ``"ab"``'s first token (dropped), ``" cd"`` is longer
    (dropped), ``" ef"`` changes only its first token (kept)."""

    table = {"ab": [1, 2], " ab": [1, 3], "cd": [4], " cd": [9, 4], "ef": [5, 6], " ef": [7, 6],
             "": []}

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return list(self.table[text])


def test_the_spaced_spelling_is_kept_only_with_the_same_length_and_another_first_token():
    assert tokenize_bad_words(_StubTokenizer(), ["ab", " cd", "\tef"]) == ((1, 2), (4,), (5, 6), (7, 6))


# ---- the rows (no model) --------------------------------------------------------------------------


def test_verify_rows_ban_words_completed_by_outputs_and_drafts():
    """Each of a request's K + 1 verify rows is the reference after its outputs and d_1 .. d_j:
    words whose prefix the drafts complete mid-block, a prefix longer than the history so far,
    two words on one entry (one matching, one not), a one-token word on every row; the raw
    logits are left alone, a request without bad words beside them is not masked."""
    g = torch.Generator().manual_seed(0)
    vocab, k = 40, 5
    words = [(9,), (5, 12), (3, 12), (12, 5, 3), (11, 5, 12, 5), (7, 5, 11, 5, 12), (30, 31)]
    a = Sequence(0, [1, 2, 3], SamplingParams(temperature=0, bad_words_token_ids=words),
                 output_token_ids=[7, 5, 11, 5])
    # short history: one output; a 5-token word completed only at row 3 by the drafts
    b = Sequence(1, [4], SamplingParams(temperature=0.8, bad_words_token_ids=[(2, 8, 4, 2, 9), (0, 2, 8), (8, 4)]),
                 output_token_ids=[2])
    plain = Sequence(2, [4], SamplingParams(temperature=0, logit_bias={3: 1.0}), output_token_ids=[5, 12])
    logits = torch.randn(3 * (k + 1), vocab, generator=g).to(torch.bfloat16)
    drafts = torch.tensor([[12, 5, 3, 5, 1], [8, 4, 2, 9, 6], [5, 12, 5, 12, 5]])
    raw = logits.clone()
    got = penalized_rows(logits, [a, b, plain], k + 1, drafts)
    assert torch.equal(logits, raw) and set(got) == {0, 1, 2}
    hits = {}
    for i, seq in enumerate((a, b, plain)):
        for j in range(k + 1):
            past = seq.output_token_ids + drafts[i, :j].tolist()
            want = reference_rows(logits[i * (k + 1) + j].float(), seq.prompt_token_ids, past, seq.params)
            torch.testing.assert_close(got[i][j].double(), want, rtol=1e-6, atol=1e-5)
            hits[i, j] = set((~torch.isfinite(got[i][j])).nonzero().view(-1).tolist())
    # the cases the reference must have met (so the comparison has teeth)
    assert hits[0, 0] == {9, 12} and hits[0, 1] == {9, 5} and hits[0, 2] == {9, 12, 3}
    assert hits[0, 4] == {9, 12} and hits[0, 5] == {9}
    assert hits[0, 3] == {9, 12}  # (3, 12) after d_2 = 3
    # b: row 0's history [2] is shorter than (0, 2)'s and (2, 8, 4, 2)'s prefixes
    assert hits[1, 0] == set() and hits[1, 1] == {4} and hits[1, 2] == set() and hits[1, 3] == {9}
    assert all(not hits[2, j] for j in range(k + 1))
    one = penalized_rows(logits[:1], [a])[0]  # a decode row: the outputs only
    assert torch.equal(one[0], got[0][0])
    fresh = Sequence(3, [1], SamplingParams(temperature=0, bad_words_token_ids=[(6,), (1, 2)]))
    first = penalized_rows(logits[:1], [fresh])[0][0]  # no outputs yet: only the one-token word
    assert set((~torch.isfinite(first)).nonzero().view(-1).tolist()) == {6}


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_match_the_reference_in_one_upload(seed, monkeypatch):
    """Random requests, histories (some shorter than their prefixes), drafts and words, many
    taken from the histories and drafts so that they match; with allowed_token_ids and
    penalties on some. Every row is the reference, one int64 upload per step, and each
    request's rows are bitwise its rows alone."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab, k, num = 30, rng.randint(1, 6), rng.randint(1, 5)
    drafts = torch.randint(0, vocab, (num, k), generator=g)
    seqs = []
    for i in range(num):
        outputs = [rng.randrange(vocab) for _ in range(rng.randint(0, 7))]
        stream = outputs + drafts[i].tolist()
        words = []
        for _ in range(rng.randint(0, 5)):
            m = rng.randint(1, 5)
            if rng.random() < 0.7 and len(stream) >= m:  # a run of outputs and drafts: matches
                s = rng.randrange(len(stream) - m + 1)
                words.append(tuple(stream[s : s + m - 1]) + (rng.randrange(vocab),))
            else:
                words.append(tuple(rng.randrange(vocab) for _ in range(m)))
        extra = rng.choice([{}, {"allowed_token_ids": rng.sample(range(vocab), 20)},
                            {"frequency_penalty": 0.5, "repetition_penalty": 1.3}])
        params = SamplingParams(temperature=rng.choice([0, 1.0]), bad_words_token_ids=words or None, **extra)
        seqs.append(Sequence(i, [rng.randrange(vocab) for _ in range(3)], params, output_token_ids=outputs))
    logits = torch.randn(num * (k + 1), vocab, generator=g)
    for seq in seqs:  # the prompt masks (repetition) go up once a request, before its first step
        penalties_module._prompt_mask(seq, vocab, logits.device)
    uploads = []
    real = penalties_module.to_device_async
    monkeypatch.setattr(penalties_module, "to_device_async", lambda t, d: uploads.append(t) or real(t, d))
    got = penalized_rows(logits, seqs, k + 1, drafts)
    # one int64 upload (the penalties that differ between requests add their float32 columns)
    assert sum(u.dtype == torch.int64 for u in uploads) == (1 if got else 0)
    assert set(got) == {i for i, s in enumerate(seqs) if s.params.has_penalties}
    for i, rows in got.items():
        seq = seqs[i]
        for j in range(k + 1):
            want = reference_rows(logits[i * (k + 1) + j], seq.prompt_token_ids,
                                  seq.output_token_ids + drafts[i, :j].tolist(), seq.params)
            torch.testing.assert_close(rows[j].double(), want, rtol=1e-6, atol=1e-5)
        alone = penalized_rows(logits[i * (k + 1) : (i + 1) * (k + 1)], [seq], k + 1, drafts[i : i + 1])[0]
        assert torch.equal(rows, alone), i


# ---- the engine -----------------------------------------------------------------------------------


def test_greedy_follows_the_reference_and_the_ban_changes_the_output(pair):
    """Target-only greedy: each token is the argmax of the reference row of the raw logits of
    the sequence so far. A word taken from the unconstrained output changes it exactly where
    the word would first be completed (the outputs before are unchanged) and never occurs."""
    target, _ = pair
    llm = LLM(target, block_size=4)
    prompt = [random.Random(1).randrange(0, 60) for _ in range(9)]
    free = free_greedy(llm, prompt, 16)
    cases = [((free[3],),), (tuple(free[5:8]),), (tuple(free[4:6]), (free[10],))]
    for words in cases:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words_token_ids=words)
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
        outputs: list[int] = []
        for _ in range(16):
            logits = llm.engine.prompt_logits(prompt + outputs)[-1]
            outputs.append(int(reference_rows(logits, prompt, outputs, params).argmax()))
        assert got == outputs and not occurs(words, got), words
        change = min(first_at(free, w) for w in words)
        assert got[:change] == free[:change] and got[change] != free[change], (words, change)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_dflash_equals_target_only_in_a_mixed_batch(pair, adaptive):
    """Greedy DFlash gives target-only's tokens for requests with bad words (with other
    processors too), batched with requests without, whose output is the one they get alone."""
    target, draft = pair
    base = LLM(target, block_size=4, max_num_seqs=8)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=8,
               adaptive_k=adaptive)
    if adaptive:
        spec.engine.k_policy.explore_every = 2
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (5, 12, 8, 20, 3, 9)]
    free = [free_greedy(base, p, 24) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plist = [replace(greedy, bad_words_token_ids=[tuple(free[0][6:9])]),
             greedy,
             replace(greedy, bad_words_token_ids=[(free[2][1],), tuple(free[2][10:12])], frequency_penalty=0.4),
             replace(greedy, bad_words_token_ids=[tuple(free[3][2:4]), tuple(free[3][7:10]), (free[3][15],)],
                     allowed_token_ids=sorted(set(range(VOCAB)) - {free[3][0]})),
             greedy,
             replace(greedy, bad_words_token_ids=[(free[5][0],), tuple(free[5][3:5])], logit_bias={free[5][0]: 100.0})]
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=plist)]
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=plist)]
    assert got == want
    for i, p in enumerate(plist):
        if p.bad_words_token_ids is None:
            assert got[i] == free[i]  # unchanged by its batch mates' words
        else:
            assert got[i] != free[i] and not occurs(p.bad_words_token_ids, got[i]), i
    metrics = spec.get_metrics()
    assert metrics["num_drafts"] > 0 and (adaptive or metrics["num_accepted_tokens"] > 0)


def test_oracle_drafts(pair):
    """Drafts that ARE target-only's constrained tokens are all accepted (no verify row bans
    too much); drafts that are the UNconstrained tokens, which complete a banned word mid-block,
    are rejected at that row (a row scored without the drafts before it would accept them):
    the output is target-only's either way."""
    target, draft = pair
    k = BLOCK_SIZE - 1
    base = LLM(target, block_size=4, max_num_seqs=8)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (6, 11, 4, 15)]
    frees = {tuple(p): free_greedy(base, p, 30) for p in prompts}
    plist = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            bad_words_token_ids=[tuple(frees[tuple(p)][3 + i : 6 + i]),
                                                 tuple(frees[tuple(p)][14:16])])
             for i, p in enumerate(prompts)]
    want = {tuple(p): o.token_ids for p, o in
            zip(prompts, base.generate(prompt_token_ids=prompts, sampling_params=plist))}
    for source, all_accepted in ((want, True), (frees, False)):
        spec = LLM(target, draft=draft, num_speculative_tokens=k, block_size=4, max_num_seqs=8)

        def oracle(seqs, k_step=None, source=source):
            k_step = k_step or k
            return torch.tensor([(source[tuple(s.prompt_token_ids)][len(s.output_token_ids):] + [0] * k_step)[:k_step]
                                 for s in seqs])

        spec.engine.proposer.propose = oracle
        got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=plist)]
        assert got == [want[tuple(p)] for p in prompts]
        metrics = spec.get_metrics()
        if all_accepted:
            assert metrics["num_accepted_tokens"] >= metrics["num_draft_tokens"] - len(prompts) * k
        else:  # the free drafts were taken up to each banned word's last token
            assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]
    assert all(want[tuple(p)] != frees[tuple(p)] for p in prompts)


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (1.5, 5), (0.7, 0)])
def test_seeded_sampling_never_produces_a_banned_word(pair, temperature, top_k):
    """Seeded sampling with and without a drafter: the most frequent token and bigram of the
    unconstrained samples are banned; no output contains them. Without top-k, each target-only
    output is the unconstrained one up to where that first produced a banned word (the same
    noise, and a banned token that lost the race removed from it changes no winner), different
    there (top-k instead lets the next token into the race where a banned one leaves it)."""
    target, draft = pair
    base = LLM(target, block_size=4, max_num_seqs=8)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=8)
    prompts = [[random.Random(i).randrange(0, 60) for _ in range(7)] for i in range(8)]
    sampled = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=16, ignore_eos=True, seed=10 + i)
               for i in range(8)]
    free = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=sampled)]
    counts: dict[tuple[int, ...], int] = {}
    for out in free:
        for s in range(len(out)):
            for m in (1, 2):
                if s + m <= len(out):
                    counts[tuple(out[s : s + m])] = counts.get(tuple(out[s : s + m]), 0) + 1
    single = max((w for w in counts if len(w) == 1), key=counts.get)
    bigram = max((w for w in counts if len(w) == 2 and single[0] not in w), key=counts.get)
    words = [single, bigram]
    banned = [replace(p, bad_words_token_ids=words) for p in sampled]
    for llm in (base, spec):
        outs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=banned)]
        assert not any(occurs(words, o) for o in outs), llm.engine.proposer is not None
        if llm is base and top_k == 0:
            for out, f in zip(outs, free):
                hit = [first_at(f, w) for w in occurs(words, f)]
                if hit:
                    assert out[:min(hit)] == f[:min(hit)] and out[min(hit)] != f[min(hit)]
                else:
                    assert out == f
        if llm is base:
            assert outs != free


def test_logprobs_stay_raw(pair):
    """The logprobs are the model's raw ones: the banned first token is listed with its raw
    logprob, with and without a drafter."""
    target, draft = pair
    prompt = [5, 17, 22, 5, 40]
    base = LLM(target, block_size=4)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4)
    free = free_greedy(base, prompt, 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                            bad_words_token_ids=[(free[0],), tuple(free[2:4])])
    for llm in (base, spec):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert out.token_ids[0] != free[0]
        for n, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            raw = torch.log_softmax(base.engine.prompt_logits(prompt + out.token_ids[:n])[-1].double(), -1)
            assert entry[token] == pytest.approx(float(raw[token]), abs=1e-4)
        raw0 = torch.log_softmax(base.engine.prompt_logits(prompt)[-1].double(), -1)
        assert out.logprobs[0][free[0]] == pytest.approx(float(raw0[free[0]]), abs=1e-4)


# ---- words through the demo pair's tokenizer ------------------------------------------------------


@pytest.fixture(scope="module")
def demo_llms():
    return (LLM(str(DEMO_TARGET), max_model_len=256),
            LLM(str(DEMO_TARGET), draft=str(DEMO_DRAFT), max_model_len=256))


DEMO_PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"


def words_from(tok, tokens: list[int]) -> tuple[str, str]:
    """Two words out of the greedy output ``tokens``: one of a single token and one of two,
    each spelled so that :func:`tokenize_bad_words` gives exactly those tokens (a run of
    letters the output really holds)."""
    found = {}
    for m in (1, 2):
        for s in range(2, len(tokens) - m):
            text = tok.decode(tokens[s : s + m])
            if (text.strip().isidentifier() and tuple(tokens[s : s + m]) in tokenize_bad_words(tok, [text])
                    and m not in found):
                found[m] = text
    return found[1], found[2]


def test_bad_words_strings_through_llm_generate(demo_llms):
    """LLM.generate tokenizes bad_words: the demo pair's greedy output loses two words taken
    from its unconstrained output (none of their token sequences occurs), DFlash = target-only,
    and a request without words in the same call is unchanged."""
    base, spec = demo_llms
    tok = base.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = base.generate([DEMO_PROMPT], greedy)[0].token_ids
    one, two = words_from(tok, free)
    params = replace(greedy, bad_words=[one, two])
    ids = tokenize_bad_words(tok, [one, two])
    outs = {}
    for llm in (base, spec):
        a, b = llm.generate([DEMO_PROMPT, DEMO_PROMPT], [params, greedy])
        assert b.token_ids == free
        outs[llm is spec] = a.token_ids
        assert a.token_ids != free and not occurs(ids, a.token_ids), (one, two)
    assert outs[True] == outs[False]


def test_bad_words_need_a_tokenizer_and_the_engine_needs_the_ids(pair):
    target, _ = pair
    llm = LLM(target, block_size=4)
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words: .* has no tokenizer"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(bad_words=["x"]))
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words are words: .*bad_words_token_ids"):
        llm.engine.add_request([1, 2], SamplingParams(bad_words=["x"]))
    with pytest.raises(ValueError, match=rf"bad_words token ids \[{VOCAB}\] are outside the vocabulary"):
        llm.engine.add_request([1, 2], SamplingParams(bad_words_token_ids=[(3, VOCAB)]))
    with pytest.raises(ValueError, match="allowed_token_ids .* are all one-token bad_words"):
        llm.engine.add_request([1, 2], SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[(3,), (4,)]))
    with pytest.raises(ValueError, match="allowed_token_ids .* are all one-token bad_words .* min_tokens"):
        llm.engine.add_request([1, 2], SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[(3,)],
                                                      stop_token_ids=[4], min_tokens=2))
    # a word whose prefix leaves the allowed token free is taken
    llm.engine.add_request([1, 2], SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[(3,), (3, 4)]))


@pytest.mark.parametrize("value, needle", [
    ("foo", "must be a list of words"),
    ([], None),
    ([""], "non-empty strings"),
    (["ok", "  "], "non-empty strings"),
    (["ok", 3], "non-empty strings"),
])
def test_bad_words_values_are_checked_naming_the_field(value, needle):
    if needle is None:
        params = SamplingParams(bad_words=value)
        assert params.bad_words is None and not params.has_penalties
        return
    with pytest.raises(ValueError, match=rf"SamplingParams\.bad_words .*{needle}"):
        SamplingParams(bad_words=value)


@pytest.mark.parametrize("value", [[()], [(1, -2)], [(1, True)], (5,), [[1.0]]])
def test_bad_token_id_sequences_are_refused(value):
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words_token_ids must be"):
        SamplingParams(bad_words_token_ids=value)


def test_token_id_sequences_are_stored_as_tuples():
    params = SamplingParams(bad_words=["a"], bad_words_token_ids=[[3, 4], (5,)])
    assert params.bad_words_token_ids == ((3, 4), (5,)) and params.has_penalties
    assert SamplingParams(bad_words_token_ids=[]).bad_words_token_ids is None


def test_request_fields_reach_sampling_params_and_bad_ones_are_400s():
    from laguna_dflash.server.errors import APIError
    from laguna_dflash.server.protocol import ChatCompletionRequest, CompletionRequest
    from laguna_dflash.server.sampling import build_sampling_params, reject_unsupported

    for req in (CompletionRequest(prompt="x", bad_words=["foo", " bar baz"]),
                ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], bad_words=["foo", " bar baz"])):
        reject_unsupported(req)  # no longer a "not supported"
        assert build_sampling_params(req, 4, None, {}).bad_words == ["foo", " bar baz"]
    for req in (CompletionRequest(prompt="x"), CompletionRequest(prompt="x", bad_words=[])):
        assert build_sampling_params(req, 4, None, {}).bad_words is None
    for bad in ([""], ["a", " \n"]):
        with pytest.raises(APIError) as info:
            build_sampling_params(CompletionRequest(prompt="x", bad_words=bad), 4, None, {})
        assert info.value.status == 400 and info.value.param == "bad_words", bad


# ---- live servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """A target-only server without a tokenizer (token-id prompts)."""
    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path_factory.mktemp("bad_words_bare") / "target", seed=0)
    with df.tiny_http_server(target, "--max-model-len", "64") as http:
        yield http


@pytest.mark.parametrize("value, needle", [
    (["foo"], "need a tokenizer"),
    ("foo", "bad_words"),
    ([3], "bad_words"),
    ([""], "non-empty words"),
])
def test_bad_words_without_a_tokenizer_are_a_400_and_the_server_goes_on(bare_server, value, needle):
    http = bare_server
    body = {"prompt": [3, 1, 4], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    for extra in ({}, {"stream": True}, {"n": 2}):
        r = http.post("/v1/completions", json={**body, **extra, "bad_words": value})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        # pydantic names the entry of a list that is not a string: bad_words.0
        assert error["param"].split(".")[0] == "bad_words" and needle in error["message"], error
    for ok_value in (None, []):
        ok = http.post("/v1/completions", json={**body, "bad_words": ok_value})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the demo has none


@pytest.fixture(scope="module")
def demo_server():
    import dflash_fixtures as df

    with df.tiny_http_server(DEMO_TARGET, "--max-model-len", "128", "--chat-template", CHAT_TEMPLATE) as http:
        yield http


def test_completions_honour_bad_words_over_http(demo_server, demo_llms):
    """The demo target's server: a request's bad_words give offline LLM.generate's tokens
    (streamed or not), not the unconstrained ones; sampled choices never hold a banned word;
    the chat route takes the field too."""
    http = demo_server
    base, _ = demo_llms
    tok = base.tokenizer
    body = {"prompt": DEMO_PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    words = list(words_from(tok, free))
    ids = tokenize_bad_words(tok, words)
    offline = base.generate([DEMO_PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                          bad_words=words))[0].token_ids
    r = http.post("/v1/completions", json={**body, "bad_words": words})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    assert got == offline and got != free and not occurs(ids, got)
    streamed = http.post("/v1/completions", json={**body, "bad_words": words, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == offline
    sampled = http.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 7, "n": 4,
                                                 "bad_words": words})
    assert sampled.status_code == 200, sampled.text
    assert not any(occurs(ids, c["token_ids"]) for c in sampled.json()["choices"])
    messages = [{"role": "user", "content": DEMO_PROMPT}]
    chat = http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "bad_words": words})
    assert chat.status_code == 200, chat.text
    offline_chat = base.chat(messages, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                      bad_words=words), chat_template=CHAT_TEMPLATE)[0]
    free_chat = base.chat(messages, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          chat_template=CHAT_TEMPLATE)[0]
    assert chat.json()["choices"][0]["token_ids"] == offline_chat.token_ids != free_chat.token_ids
