"""Randomised engine stress: many requests under KV pressure, with and without DFlash.

32 requests of very different lengths (half share a system prompt, so the prefix cache hits)
and max_tokens (some run to max_model_len), some ending on a stop token, some seeded-sampled,
some asking for logprobs or prompt logprobs, some with logits processors (allowed_token_ids,
bad words taken from their own output, logit bias, min_tokens before a stop token, presence /
frequency / repetition penalties, mixed; a verify's rows must count its drafts), a third with
a structured-output constraint (a regex over a spelling of the fixture's vocabulary, compiled
by outlines-core: :data:`REGEXES`; alone or with those processors; a verify's rows follow its
guided drafts), arrive at random steps into an engine whose KV cache holds a few sequences, so
requests are preempted and recomputed; some are aborted mid-run, and the prefix cache is reset
now and then. Every request must produce what target-only decoding of it alone produces
(tokens, greedy and seeded alike, and the logprobs of its tokens; an aborted one a prefix of
that), and no output may hold a token outside its allowed_token_ids or one of its bad words (m
tokens: as m consecutive outputs), or leave its constraint (:func:`constraint_error`: a token
its grammar refuses; a stop token outside a final state or, before min_tokens, outside a
complete output).
After every step the block bookkeeping must be exact (reference counts = block-table entries,
the free pool = the unreferenced blocks, no block twice in a table, the prefix-cache maps
inverse to each other), and no block registered in the prefix cache may be written while it
keeps its hash (its target K/V and its drafter context K/V are what later prompts reuse). At the end every block is free.

Configurations: target-only; DFlash at fixed K, whole-prompt prefills; a scripted per-step K
(0: target-only steps whose taps wait as pending taps) with the drafter context stored by the
next step instead of the verify; the graph runners' padded path on CPU (drafts queued ahead;
with the scripted K, target forwards queued ahead too), whose block-table rows, written
incrementally, must equal a full rewrite after every forward. The fixture's drafter is random (almost
never accepted), so all but the fixed-K run replace the draft values by :class:`OracleDrafts`:
every acceptance count happens, and requests end inside accepted blocks (on a stop token, at
max_tokens, at max_model_len), also across a KV block boundary.

Also: an ``LLM.generate`` call whose step fails leaves none of its requests in the engine.

CPU, float32, the Laguna / Poolside pair of tests/dflash_fixtures.py.
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

import pytest
import regex as partial_regex
import torch

from laguna_dflash import LLM, SamplingParams, StructuredOutputsParams
from laguna_dflash.engine.engine import LLMEngine
from laguna_dflash.engine.sequence import Sequence
from laguna_dflash.structured_outputs import Grammar, GrammarMatcher, terminated_vocabulary

BLOCK_SIZE = 6  # the drafter's block: K <= 5
MAX_MODEL_LEN = 60
VOCAB = 60  # prompt token range (the fixture's vocabulary is larger)
MODEL_VOCAB = 64  # the fixture's vocabulary: the grammars'

# ---- structured outputs over the fixture's vocabulary (it has no tokenizer) ------------------
#: token id -> its text: single characters, and pairs and triples of them (so one text has
#: several token sequences, and a token can cross a word boundary); "#" has one token only.
#: Tokens 60 and 61 are spelled as nothing: a grammar allows them only as stop tokens, in a
#: final state
SPELLING: dict[int, str] = dict(zip([*range(60), 62, 63], [
    *"abcdexyz", *"0123456789", " ", "-", "#", "q",
    "ab", "ba", "ca", "ac", "bc", "cd", "da", "ad", "ce", "ec", "de", "be", "xy", "yz", "zx", "xx",
    "12", "34", "56", "78", "90", "01", "42", "99", "07",
    "abc", "cab", "bad", "ace", "dad", "bead", " a", "a ", "-1", " b", "aq", "e ", " d", "d a", "0-"]))
UNSPELLED = (60, 61)
#: name -> regex, compiled as the engine's compiler does (Grammar.from_regex: with the end mark
#: that keeps outlines-core from dropping one-character steps out of a complete match, e.g. "b"
#: after "cab" in "words"); a regex's states that allow no token need a stop token
REGEXES = {
    "words": r"(cab|bad|dace|abcd|ba)( (cab|bad|dace|abcd|ba))*",  # a loop of choices
    "choice": r"(abcd|bead|cab|dada|ba)",  # finite: ends on a stop token
    "ab-or-c": r"(ab|c)+d?",
    "forced": r"#([0-9]{2,3}-#)+",  # "#" and "-" forced: one token allowed
    "forced-end": r"(#[0-9]{2,3}-)+",  # and after "-" the stop token alone
    "most": r"[^q]*",  # every token but the two with a "q"
}


@dataclass(frozen=True)
class Constraint:
    """A compiled regex of :data:`REGEXES`, over :data:`SPELLING`, and the tokens each of its
    reachable states allows (``allowed``)."""

    name: str
    grammar: Grammar
    allowed: dict[int, frozenset[int]]

    @property
    def ends(self) -> bool:
        """Whether a state allows no token: a request needs a stop token (ignore_eos), else its
        row there would be all -inf."""
        return not all(self.allowed.values())

    @property
    def fewest(self) -> int:
        """The fewest tokens a state that allows any allows."""
        return min(len(a) for a in self.allowed.values() if a)


@functools.cache
def constraints() -> dict[str, Constraint]:
    """The :data:`REGEXES` compiled once for the module (each state's allowed tokens walked)."""
    vocabulary = terminated_vocabulary({t.encode(): [i] for i, t in SPELLING.items()}, MODEL_VOCAB)
    out = {}
    for name, regex in REGEXES.items():
        grammar = Grammar.from_regex(regex, vocabulary, MODEL_VOCAB)
        allowed, todo = {}, [grammar.initial_state]
        while todo:
            state = todo.pop()
            allowed[state] = frozenset(_allowed(grammar, state))
            assert allowed[state] or grammar.is_final(state), f"{name}: a dead state"
            todo += {grammar.next_state(state, t) for t in allowed[state]} - set(allowed) - set(todo)
        out[name] = Constraint(name, grammar, allowed)
    return out


def _allowed(grammar: Grammar, state: int) -> set[int]:
    """The tokens ``state`` allows (the end mark, the id past the vocabulary, left out)."""
    return {t for t in grammar.index.get_allowed_tokens(state) if t < grammar.vocab_size}


def constraint_of(params: SamplingParams) -> Constraint | None:
    if params.structured_grammar is None:
        return None
    return next(c for c in constraints().values() if c.grammar is params.structured_grammar)


def constraint_error(params: SamplingParams, output: list[int]) -> str | None:
    """Where ``output`` leaves its request's constraint (None: nowhere), from the definition:
    the grammar's automaton walked over the tokens before the first stop token refuses none
    of them; a stop token (it ends the request: nothing may follow it) comes where the state
    is final or the grammar spells it, and before min_tokens only where the state allows stop
    tokens alone (a complete output); and independently of the automaton, the tokens' text is
    a prefix of a match of the regex (Python's ``regex``), a whole match where a stop token the
    grammar does not spell there ended it."""
    grammar, stops = params.structured_grammar, set(params.stop_token_ids or ())
    ends = next((n for n, t in enumerate(output) if t in stops), len(output))
    state = grammar.initial_state
    for n, t in enumerate(output[:ends]):
        state = grammar.next_state(state, t)
        if state is None:
            return f"output {n} (token {t}) refused"
    text = "".join(SPELLING[t] for t in output[:ends])
    if partial_regex.fullmatch(grammar.regex, text, partial=True) is None:
        return f"{text!r} is no prefix of a match"
    if ends == len(output):
        return None
    stop = output[ends]
    if ends + 1 < len(output):
        return f"outputs after the stop token at {ends}"
    if grammar.next_state(state, stop) is None:  # a stop token as itself: the state is final
        if not grammar.is_final(state):
            return f"stop token {stop} at {ends} in a state that is not final"
        if partial_regex.fullmatch(grammar.regex, text) is None:
            return f"{text!r}, ended by stop token {stop}, is no match"
    if ends < params.min_tokens and not _allowed(grammar, state) <= stops:
        return f"stop token {stop} at {ends} before min_tokens={params.min_tokens}"
    return None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("stress"), BLOCK_SIZE)


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: SamplingParams


def _workload(seed: int, n: int = 32) -> list[tuple[tuple[int, ...], SamplingParams]]:
    """Prompts (half start with one 15-token system prompt, cut anywhere) of 1 .. 41 tokens,
    max_tokens 1 .. 45 (None: up to max_model_len), a third sampled with a seed, some with logits
    processors (:func:`_processors`; most of the longer ones), some with a structured-output
    constraint (:func:`_constraint`; most of the longer ones, the :data:`REGEXES` in turn).
    Stop tokens and bad words are chosen later from the reference output (random ids would
    rarely stop or ban anything), a constrained request's stop token here (it changes the
    output before it)."""
    rng = random.Random(seed)
    extra = random.Random(f"{seed}-processors")  # the prompts etc. stay those of the rng alone
    pick, constrain = random.Random(f"{seed}-constrained"), random.Random(f"{seed}-constraints")
    kinds = itertools.cycle(constrain.sample(list(constraints().values()), len(REGEXES)))  # each in turn
    system = [rng.randrange(VOCAB) for _ in range(15)]
    out = []
    for _ in range(n):
        head = system[: rng.randrange(3, 16)] if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 5, 9, 17, 26]))]
        max_tokens = rng.choice([1, 2, 3, 7, 15, 30, 45, None])
        sampled = rng.random() < 0.33
        fields = dict(temperature=0.9 if sampled else 0.0, max_tokens=max_tokens, ignore_eos=True,
                      seed=rng.randrange(1000) if sampled else None,
                      logprobs=2 if rng.random() < 0.2 else None,
                      prompt_logprobs=1 if rng.random() < 0.15 else None,
                      **(_processors(extra, max_tokens)
                         if extra.random() < (0.75 if _long(max_tokens) else 0.3) else {}))
        if pick.random() < (0.7 if _long(max_tokens) else 0.15):
            fields.update(_constraint(constrain, next(kinds), fields))
        out.append((tuple(prompt), SamplingParams(**fields)))
    return out


def _constraint(rng: random.Random, c: Constraint, fields: dict) -> dict:
    """The fields that give a request (its processors ``fields``) structured output ``c``: the
    regex, and its grammar compiled (the fixture has no tokenizer); a stop token where the
    grammar has an end (ignore_eos: else nothing would be left to generate there), else 40% of
    the time: mostly a token spelled as nothing (allowed in final states only), else any
    (allowed too where the grammar spells it); then min_tokens half the time (a stop token is
    banned before it, unless the constraint allows stop tokens alone).

    No row may be left all -inf by two masks: a request's allowed_token_ids get, besides their
    own ids, one token that each state of the grammar allows (so every state reached keeps an
    allowed one) and the stop token (all an end allows); bad words go only to a request whose
    grammar allows 10 tokens or more in every state and that has no allowed_token_ids
    (:func:`expected_requests`: its 3 words ban at most 3 a row). Logit bias and penalties
    leave a row finite."""
    out = {"structured_outputs": StructuredOutputsParams(regex=c.grammar.regex), "structured_grammar": c.grammar}
    if c.ends or rng.random() < 0.4:
        out["stop_token_ids"] = [rng.choice(UNSPELLED) if rng.random() < 0.7 else rng.randrange(VOCAB)]
        if "min_tokens" not in fields and rng.random() < 0.5:
            out["min_tokens"] = rng.randrange(1, min(fields["max_tokens"] or 16, 16) + 1)
    if fields.get("allowed_token_ids"):
        cover = {rng.choice(sorted(a)) for a in c.allowed.values() if a}
        out["allowed_token_ids"] = sorted(set(fields["allowed_token_ids"]) | cover | set(out.get("stop_token_ids", ())))
    return out


def _long(max_tokens: int | None) -> bool:
    """Long enough for verifies to score several rows with a request's processors."""
    return max_tokens is None or max_tokens >= 7


def _processors(rng: random.Random, max_tokens: int | None) -> dict:
    """Some of: allowed_token_ids (5 .. 9 ids: more than a row's bad words and stop token can
    ban, so no row is left all -inf), presence / frequency / repetition penalties, a logit bias,
    min_tokens (at most max_tokens; it matters once a stop token is chosen)."""
    fields: dict = {}
    long = _long(max_tokens)
    if rng.random() < (0.6 if long else 0.15):
        fields["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randrange(5, 10))
    if rng.random() < (0.6 if long else 0.3):  # strong enough to turn the looping outputs
        fields.update(presence_penalty=rng.choice([0.0, 0.5, -0.5, 1.5]),
                      frequency_penalty=rng.choice([0.0, 0.5, 1.0, 2.0, -0.5]),
                      repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.0]))
    if rng.random() < 0.3:
        fields["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-100.0, -3.0, 2.0, 5.0])
                                for _ in range(rng.randrange(1, 4))}
    if rng.random() < (0.6 if "allowed_token_ids" in fields else 0.3):  # a small alphabet stops early
        fields["min_tokens"] = rng.randrange(1, min(max_tokens or 40, 40) + 1)
    return fields


def _bad_words(rng: random.Random, params: SamplingParams, output: list[int], stop: int | None
               ) -> tuple[tuple[int, ...], ...]:
    """1 .. 3 bad words of 1 .. 3 tokens, mostly windows of ``output`` (the request's reference
    output without them, so they do ban what it would generate: the first one inside max_tokens),
    else small random ids. Never the stop token as a one-token word; with allowed_token_ids,
    at least 4 allowed ids stay unbanned by one-token words (a row's longer words and stop token
    ban at most 3 more)."""
    words: list[tuple[int, ...]] = []
    single: set[int] = set()
    allowed = set(params.allowed_token_ids or range(VOCAB))
    for _ in range(rng.randrange(1, 4)):
        m = rng.choice([1, 2, 2, 3, 3])
        if output and rng.random() < 0.75:
            i = rng.randrange(max(1, min(len(output), params.max_tokens) - m + 1))  # inside max_tokens
            word = tuple(output[i : i + m])
        else:
            word = tuple(rng.randrange(VOCAB) for _ in range(m))
        if word in words or (len(word) == 1 and (word[0] == stop or len(allowed - single - set(word)) < 4)):
            continue
        single |= set(word) if len(word) == 1 else set()
        words.append(word)
    return tuple(words)


def _banned_in(output: list[int], words) -> list[tuple[int, ...]]:
    """The bad words that appear as consecutive tokens of ``output`` (the definition checked
    against the outputs alone: a word of m tokens as m consecutive output tokens)."""
    return [w for w in words or () if any(tuple(output[i : i + len(w)]) == w
                                          for i in range(len(output) - len(w) + 1))]


@dataclass(frozen=True)
class Expected:
    """A request's output alone: its tokens, the logprob of each output / prompt token (None
    where the request does not ask for them), and ``continuation``: the tokens target-only
    decoding gives it up to max_model_len, past its max_tokens and stop token (what a perfect
    drafter would propose there)."""

    token_ids: list[int]
    logprobs: list[float] | None
    prompt_logprobs: list[float] | None
    continuation: list[int]


def _chosen(entries, tokens) -> list[float] | None:
    """The logprob of each chosen token (a top-n tie may list other tokens, batch to batch)."""
    return None if entries is None else [e[t] for e, t in zip(entries, tokens)]


@pytest.fixture(scope="module")
def requests(pair) -> list[tuple[Request, Expected]]:
    return expected_requests(pair[0], seed=0)


def expected_requests(target, seed: int) -> list[tuple[Request, Expected]]:
    """The workload with stop tokens and bad words, and each request's target-only output alone
    (batch 1, no prefix cache, no preemption, the request's own params: its logits processors
    and constraint too): its tokens to max_model_len (a seeded request's too: its noise is a
    function of the output position), cut at max_tokens and after the first occurrence of its
    stop token. A stop token and the bad words are taken from the request's own output; where
    they change it (bad words; a stop token under min_tokens, banned before it) the output is
    computed again with them (a stop token alone changes no token before it, so the continuation
    runs past it). A constrained request keeps the stop token of :func:`_workload` (allowed in
    the grammar's final states, it changes the tokens before it), so its output alone ends on
    it; each reference obeys its constraint (:func:`constraint_error`)."""
    base = LLM(target, block_size=4, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)

    def alone(prompt, params, **changes):
        return base.generate(prompt_token_ids=[list(prompt)], sampling_params=SamplingParams(
            **{**_fields(params), "max_tokens": None, **changes}))[0]

    rng = random.Random(seed + 1)
    words_rng = random.Random(f"{seed}-bad-words")
    constrained_words_rng = random.Random(f"{seed}-constrained-bad-words")
    out = []
    num_banning = 0  # requests whose output without their bad words holds one
    complete = 0  # constrained requests that end before min_tokens: their output is complete
    for prompt, params in _workload(seed=seed):
        constraint = constraint_of(params)
        first = alone(prompt, params)
        continuation = first.token_ids
        full = continuation[: params.max_tokens]
        stop = None
        if constraint is not None:
            stop = params.stop_token_ids[0] if params.stop_token_ids else None
        elif len(full) > 2 and rng.random() < 0.4:
            stop = full[rng.randrange(1, len(full))]
            params = SamplingParams(**{**_fields(params), "stop_token_ids": [stop]})
        # a constrained request's words from a stream of their own; where its grammar leaves
        # many tokens a row (_constraint: none is left with nothing)
        chooser = words_rng if constraint is None else constrained_words_rng
        may_ban = constraint is None or (constraint.fewest >= 10 and not params.allowed_token_ids)
        if chooser.random() < (0.5 if constraint is None else 0.35) and may_ban:
            words = _bad_words(chooser, params, continuation, stop)
            num_banning += bool(_banned_in(full, words))  # it would generate one of them
            params = SamplingParams(**{**_fields(params), "bad_words_token_ids": words or None})
        if params.bad_words_token_ids or (stop is not None and params.min_tokens and constraint is None):
            # the stop token goes in where min_tokens bans it (the run ends on it there)
            first = alone(prompt, params, **({} if params.min_tokens or constraint else {"stop_token_ids": None}))
            continuation = first.token_ids
            full = continuation[: params.max_tokens]
        if stop is not None and stop in full[params.min_tokens :]:
            full = full[: full.index(stop, params.min_tokens) + 1]
        assert not _banned_in(full, params.bad_words_token_ids)
        assert set(full) <= set(params.allowed_token_ids or full)
        if constraint is None:
            assert stop not in full[: params.min_tokens]
        else:  # a stop token before min_tokens only where the output is complete
            assert constraint_error(params, full) is None, (constraint.name, full, constraint_error(params, full))
            complete += stop in full[: params.min_tokens]
        out.append((Request(prompt, params), Expected(
            full, _chosen(first.logprobs, full),
            _chosen((first.prompt_logprobs or [None])[1:], prompt[1:]) if params.prompt_logprobs else None,
            continuation)))
    assert any(e.logprobs for _, e in out) and any(e.prompt_logprobs for _, e in out)
    # the processors are there, and the bad words do ban what the requests would generate
    chosen = [r.params for r, _ in out]
    assert num_banning >= 5, num_banning
    assert sum(p.allowed_token_ids is not None for p in chosen) >= 3
    assert any(p.allowed_token_ids and p.bad_words_token_ids for p in chosen)
    assert any(p.min_tokens and p.stop_token_ids for p in chosen)
    assert any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in chosen)
    assert any(p.logit_bias for p in chosen)
    # the constraints are there: each of them, alone and with the other processors, ending on
    # stop tokens (also one the constraint's end lets in before min_tokens) and at max_tokens
    constrained = [(r.params, e.token_ids) for r, e in out if r.params.structured_grammar is not None]
    assert {constraint_of(p).name for p, _ in constrained} == set(REGEXES)
    assert sum(len(full) >= 7 for _, full in constrained) >= 4
    assert any(p.bad_words_token_ids for p, _ in constrained)
    assert any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p, _ in constrained)
    assert any(full and full[-1] in UNSPELLED for _, full in constrained) and complete > 0
    assert any(full and full[-1] in (p.stop_token_ids or ()) and full[-1] not in UNSPELLED for p, full in constrained)
    assert any(len(full) == p.max_tokens for p, full in constrained)
    assert any(not p.is_greedy for p, _ in constrained) and any(p.is_greedy for p, _ in constrained)
    return out


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in SamplingParams.__dataclass_fields__}


class Invariants:
    """Per-step checks of an engine's block bookkeeping, and that a block registered in the
    prefix cache is never written while it keeps its hash (target and drafter K/V of its slots
    compared with a snapshot taken when it was first seen registered)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.snapshots: dict[int, tuple[bytes, list[torch.Tensor]]] = {}
        self.num_compared = 0
        # a block that loses its hash (evicted: handed out again; or a cache reset) may be
        # rewritten, and registered again, within one step: its snapshot goes with the hash
        alloc = engine.allocator
        forget, reset = alloc._forget, alloc.reset_prefix_cache

        def forgets(block: int) -> None:
            self.snapshots.pop(block, None)
            forget(block)

        def resets() -> None:
            self.snapshots.clear()
            reset()

        alloc._forget, alloc.reset_prefix_cache = forgets, resets

    def _caches(self):
        caches = [self.engine.runner.kv_cache]
        if self.engine.proposer is not None:
            caches.append(self.engine.proposer.kv_cache)
        return caches

    def _contents(self, block: int) -> list[torch.Tensor]:
        bs = self.engine.allocator.block_size
        return [t[block * bs : (block + 1) * bs].clone() for kv in self._caches()
                for layer in kv.layers for t in layer]

    def check(self) -> None:
        alloc, sched = self.engine.allocator, self.engine.scheduler
        holders = list(sched.running) + list(sched.prefilling)
        refs: dict[int, int] = {}
        layout = sched.layout
        for s in holders:
            held = list(s.block_table)
            if layout is not None:  # hybrid KV: each SWA group's table, trimmed to the window
                assert len(s.swa_block_tables) == layout.num_swa_groups
                first = max(0, s.num_computed - layout.sliding_window) // alloc.block_size
                for table in s.swa_block_tables:
                    assert len(table) <= len(s.block_table)
                    assert s.swa_start == min(len(table), first), f"request {s.request_id}: not trimmed"
                    assert table[: s.swa_start] == [sched.null_block] * s.swa_start
                    held += table[s.swa_start :]
                    self.num_swa_held = getattr(self, "num_swa_held", 0) + len(table) - s.swa_start
            assert len(set(held)) == len(held), f"request {s.request_id}: a block twice"
            for b in held:
                refs[b] = refs.get(b, 0) + 1
        for s in sched.waiting:
            assert not s.block_table and not s.swa_block_tables, f"waiting request {s.request_id} holds blocks"
        for b in range(alloc.num_blocks):
            assert alloc._refs[b] == refs.get(b, 0), f"block {b}: {alloc._refs[b]} refs, {refs.get(b, 0)} holders"
            assert (b in alloc._free) == (alloc._refs[b] == 0), f"block {b}: pool membership"
        assert {b: h for h, b in alloc._block_of.items()} == alloc._hash_of, "prefix-cache maps disagree"
        for s in holders:  # the cached head of a table names the request's own tokens
            for i in range(s.num_registered_blocks):
                h = alloc._hash_of.get(s.block_table[i])
                assert h is None or h == s.block_hashes[i], f"request {s.request_id}: block {i}'s hash"
                for g, table in enumerate(s.swa_block_tables if i >= s.swa_start else ()):
                    h = alloc._hash_of.get(table[i])
                    assert h is None or h == sched.swa_hash(s.block_hashes[i], g), \
                        f"request {s.request_id}: SWA group {g} block {i}'s hash"
        for block, h in list(alloc._hash_of.items()):
            seen = self.snapshots.get(block)
            if seen is None or seen[0] != h:
                self.snapshots[block] = (h, self._contents(block))
                continue
            now = self._contents(block)
            assert all(torch.equal(a, b) for a, b in zip(seen[1], now)), \
                f"cached block {block} was written while registered"
            self.num_compared += 1
        for block in set(self.snapshots) - set(alloc._hash_of):
            del self.snapshots[block]


CONFIGS = {
    # hybrid KV layout (the default: the fixture's 2 sliding layers keep only their window) and
    # the unified one; an explicit num_kv_blocks is the same memory either way
    "target-only": dict(block_size=3, num_kv_blocks=14, max_num_seqs=6, max_num_batched_tokens=7),
    "target-only-unified": dict(block_size=3, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=7,
                                disable_hybrid_kv_cache_manager=True),
    "dflash": dict(draft=True, num_speculative_tokens=5, block_size=4, num_kv_blocks=20,
                   max_num_seqs=8, enable_chunked_prefill=False),
    "dflash-k-per-step-pending-taps": dict(draft=True, oracle=True, num_speculative_tokens=3, adaptive_k=True,
                                           k_pattern=(3, 0, 0, 1, 3, 2, 0), store_in_verify=False,
                                           block_size=4, num_kv_blocks=19, max_num_seqs=6,
                                           max_num_batched_tokens=9),
    "dflash-ahead": dict(draft=True, oracle=True, num_speculative_tokens=5, graphs=True, block_size=7,
                         num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=6),
    "dflash-k-per-step-ahead": dict(draft=True, oracle=True, num_speculative_tokens=3, adaptive_k=True,
                                    k_pattern=(0, 0, 3, 0, 0, 0, 2, 3), graphs=True,
                                    decode_ahead=True, block_size=4, num_kv_blocks=20,
                                    max_num_seqs=5, max_num_batched_tokens=11),
}


class OracleDrafts:
    """Drafts from the requests' known continuations (target-only's tokens, seeded samples
    included, past max_tokens and the stop token) that turn wrong at a random index, so
    verifies accept every count 0 .. K about equally often and requests end inside accepted
    blocks (the fixture's drafter is random: it is almost never accepted). The drafter still
    runs (its block forward, its context K/V and the drafts queued ahead are computed as
    usual); only the draft values are replaced. A constrained request's drafts are still
    guided by the engine (spec_decode.DFlashProposer._guide: on the host, then uploaded into
    its row): these drafts go first among the drafter's candidates, so a position takes its
    expected token where the grammar allows it, else the drafter's likeliest allowed one."""

    def __init__(self, engine: LLMEngine, expected: dict[int, list[int]], seed: str) -> None:
        self.expected, self.rng = expected, random.Random(seed)
        self.vocab = engine.target.spec.vocab_size
        self.num_cut_inside = 0  # requests that ended before the last token a verify gave them
        propose, spec_decode, commit = engine.proposer.propose, engine._spec_decode, engine._commit
        proposer = engine.proposer
        guide, candidates = proposer._guide, proposer.drafter.draft_candidates
        first: list[torch.Tensor] = []  # the constrained requests' drafts while _guide runs

        def proposes(seqs: list[Sequence], k: int | None = None) -> torch.Tensor:
            drafts = propose(seqs, k)  # the constrained rows guided (below)
            free = torch.tensor([s.grammar is None for s in seqs]).view(-1, 1).to(drafts.device)
            return torch.where(free, self.drafts(seqs, drafts.shape[1]).to(drafts), drafts)

        def guides(drafts: torch.Tensor, hidden: torch.Tensor, seqs: list[Sequence], rows: list[int]):
            first.append(self.drafts(seqs, drafts.shape[1]).view(-1, 1))
            try:
                return guide(drafts, hidden, seqs, rows)
            finally:
                first.pop()

        def draft_candidates(hidden: torch.Tensor, count: int) -> torch.Tensor:
            best = candidates(hidden, count)
            return torch.cat([first[-1].to(best), best], dim=1) if first else best

        proposer._guide, proposer.drafter.draft_candidates = guides, draft_candidates

        def spec_decodes(seqs: list[Sequence], k: int, ahead=None):
            if ahead is not None and ahead.fits(seqs, k):  # drafts queued by the last step
                ahead.drafts = self.drafts(seqs, k).to(ahead.drafts)
            return spec_decode(seqs, k, ahead)

        def commits(seq: Sequence, tokens: list[int], *args) -> int:
            kept = commit(seq, tokens, *args)
            self.num_cut_inside += kept < len(tokens)
            return kept

        engine.proposer.propose, engine._spec_decode, engine._commit = proposes, spec_decodes, commits

    def drafts(self, seqs: list[Sequence], k: int) -> torch.Tensor:
        """``[R, k]``: request ``i``'s next ``k`` expected tokens after its bonus token, the
        first wrong one at a uniform index in ``0 .. k`` (``k``: all right)."""
        rows = []
        for s in seqs:
            n = len(s.output_token_ids)  # the bonus is output n - 1; the target's next, output n
            row = list(self.expected[s.request_id][n : n + k])
            row += [self.rng.randrange(VOCAB) for _ in range(k - len(row))]
            wrong = self.rng.randrange(k + 1)
            if wrong < k:
                row[wrong] = (row[wrong] + 1) % self.vocab
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long)


class RowsChecked:
    """Every graph runner's block-table rows (engine/host_rows.py: rows written incrementally)
    compared after each forward with the same rows rewritten from the request lists (the
    reference); counts the rows the incremental path kept (only new block ids written) and
    rewrote."""

    def __init__(self, monkeypatch) -> None:
        from laguna_dflash.engine import host_rows

        self.num_forwards = self.num_kept = self.num_rewritten = 0
        write, rewrite = host_rows.RowTables.write, host_rows.RowTables._rewrite

        def counted_rewrite(tables, *args):
            self.num_rewritten += 1
            return rewrite(tables, *args)

        def checked_write(tables, items, r_pad, nb):
            before = self.num_rewritten
            write(tables, items, r_pad, nb)
            self.num_forwards += 1
            self.num_kept += r_pad - (self.num_rewritten - before)
            fresh = host_rows.RowTables(tables.rows.copy(), tables.num_tables, tables.max_blocks,
                                        tables.scratch_block)
            monkeypatch.setattr(host_rows, "incremental", False)
            try:
                rewrite_before = self.num_rewritten
                write(fresh, items, r_pad, nb)  # the unpatched write
                self.num_rewritten = rewrite_before  # the reference's rewrites are not counted
            finally:
                monkeypatch.setattr(host_rows, "incremental", True)
            end = 2 + tables.num_tables * tables.max_blocks
            assert (tables.rows[:r_pad, 2:end] == fresh.rows[:r_pad, 2:end]).all(), "stale block-table rows"

        monkeypatch.setattr(host_rows.RowTables, "write", checked_write)
        monkeypatch.setattr(host_rows.RowTables, "_rewrite", counted_rewrite)


class ConstrainedSteps:
    """Counts the steps that mask rows with a grammar (engine/penalties.py's
    ``_grammar_row_bits``): all, those with two constrained requests or more among
    unconstrained ones (``num_mixed``; verifies: ``num_mixed_verifies``), and the constrained
    requests' verifies that read their drafts from the host (``num_guided``: the drafts
    GrammarMatcher.guided_drafts chose), which must be the drafts the verify scores (its
    device rows: the grammar's rows follow them)."""

    def __init__(self, monkeypatch) -> None:
        from laguna_dflash.engine import penalties

        self.num_steps = self.num_mixed = self.num_mixed_verifies = self.num_guided = 0
        grammar_rows, drafted = penalties._grammar_row_bits, GrammarMatcher.drafted

        def counted_rows(seqs, chosen, n, drafts):
            for i, s in enumerate(seqs):
                known = drafted(s.grammar, len(s.output_token_ids), n - 1) if s.grammar and n > 1 else None
                assert known is None or known == drafts[i].tolist(), \
                    f"request {s.request_id}: the host's guided drafts {known} are not the verify's"
            constrained = sum(s.grammar is not None for s in seqs)
            self.num_steps += constrained > 0
            mixed = 2 <= constrained < len(seqs)
            self.num_mixed += mixed
            self.num_mixed_verifies += mixed and n > 1
            return grammar_rows(seqs, chosen, n, drafts)

        def counted_drafted(matcher, num_outputs, num_drafts):
            drafts = drafted(matcher, num_outputs, num_drafts)
            self.num_guided += drafts is not None
            return drafts

        monkeypatch.setattr(penalties, "_grammar_row_bits", counted_rows)
        monkeypatch.setattr(GrammarMatcher, "drafted", counted_drafted)


def _engine(pair, monkeypatch, options: dict) -> LLM:
    from laguna_dflash.engine import engine as engine_module

    target, draft = pair
    options = dict(options)
    monkeypatch.setattr(engine_module, "store_context_in_verify", options.pop("store_in_verify", True))
    monkeypatch.setattr(engine_module, "decode_ahead", options.pop("decode_ahead", None))
    graphs, pattern = options.pop("graphs", False), options.pop("k_pattern", None)
    options.pop("oracle", None)
    if options.pop("draft", False):
        options["draft"] = draft
    llm = LLM(target, max_model_len=MAX_MODEL_LEN, **options)
    if graphs:
        llm.engine.attach_graph_runners()  # CPU: the padded path the CUDA graphs replay
    if pattern is not None:  # adaptive K's choice follows step times: a fixed script instead
        ks = itertools.cycle(pattern)
        llm.engine.k_policy.choose = lambda batch_size: next(ks)
    return llm


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_load_gives_each_requests_alone_output(pair, requests, monkeypatch, name):
    """The module docstring's workload through configuration ``name``: each request's output
    alone, inside its constraint, exact block bookkeeping after every step, cached blocks never
    rewritten, no block leaked; and the run did preempt, hit the prefix cache, stop on stop
    tokens, batch constrained requests with others (and with drafts: verify them so, their
    guided drafts those the verify reads from the host, and accept some; with oracle drafts:
    accept whole blocks and end requests inside them)."""
    llm = _engine(pair, monkeypatch, CONFIGS[name])
    engine = llm.engine
    assert (engine.kv_layout is None) == CONFIGS[name].get("disable_hybrid_kv_cache_manager", False)
    # the drafter's sliding layers keep their context in a sliding group of the pool
    assert bool(engine.kv_layout and engine.kv_layout.draft_group) == bool(CONFIGS[name].get("draft"))
    preempted: list[int] = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda s: (preempted.append(s.request_id), preempt(s))[1]
    check = Invariants(engine)
    rows = RowsChecked(monkeypatch) if CONFIGS[name].get("graphs") else None
    constrained = ConstrainedSteps(monkeypatch)
    rng = random.Random(name)
    expected: dict[int, list[int]] = {}  # request id -> its continuation alone
    oracle = OracleDrafts(engine, expected, name) if CONFIGS[name].get("oracle") else None
    todo = list(requests)
    rng.shuffle(todo)
    added: list[tuple[Sequence, Expected]] = []
    aborted: set[int] = set()
    while todo or engine.has_unfinished:
        if todo and (not engine.has_unfinished or rng.random() < 0.35):
            n = rng.randrange(1, 4)
            arriving, todo = todo[:n], todo[n:]
            for req, want in arriving:
                added.append((engine.add_request(list(req.prompt), req.params), want))
                expected[added[-1][0].request_id] = want.continuation
        live = [s for s, _ in added if not s.is_finished]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim.request_id)
        if rng.random() < 0.02:
            engine.reset_prefix_cache()
        engine.step()
        check.check()
    assert len(added) == len(requests)
    for s, want in added:
        got = s.output_token_ids
        # the processors' definitions, on the outputs alone (the reference obeys them too)
        assert set(got) <= set(s.params.allowed_token_ids or got), f"request {s.request_id}: not allowed"
        assert not _banned_in(got, s.params.bad_words_token_ids), f"request {s.request_id}: bad word"
        if s.params.structured_grammar is not None:  # an aborted one's tokens too
            assert constraint_error(s.params, got) is None, \
                f"request {s.request_id} ({constraint_of(s.params).name}): {constraint_error(s.params, got)}"
        if s.request_id in aborted:
            assert got == want.token_ids[: len(got)], f"aborted request {s.request_id}"
            assert s.finish_reason == "abort" or got == want.token_ids
            continue
        assert got == want.token_ids, (
            f"request {s.request_id} ({'greedy' if s.params.is_greedy else 'seeded'}, "
            f"{s.num_preemptions} preemptions, {s.num_cached_tokens} cached tokens)")
        if want.logprobs is not None:  # one entry per token, recomputed or not
            assert _chosen(s.logprobs, got) == pytest.approx(want.logprobs, abs=1e-4)
        if want.prompt_logprobs is not None:  # the whole prompt, in chunks or not, once
            assert s.prompt_logprobs[0] is None and len(s.prompt_logprobs) == len(s.prompt_token_ids)
            assert _chosen(s.prompt_logprobs[1:], s.prompt_token_ids[1:]) == \
                pytest.approx(want.prompt_logprobs, abs=1e-4)
    alloc = engine.allocator
    assert alloc.num_free_blocks == alloc.num_blocks, "KV blocks leaked"
    assert sum(alloc._refs) == 0
    # the run exercised what it is about
    assert preempted, "no preemption: the KV cache is too large for this workload"
    assert engine.scheduler.num_prefix_hits > 0 and check.num_compared > 0
    assert any(s.finish_reason == "stop" for s, _ in added)
    # constrained requests batched with others, several at once (in verifies: their rows
    # after drafts; the drafts guided, read from the host), and their drafts accepted
    assert constrained.num_mixed > 0, vars(constrained)
    if CONFIGS[name].get("draft"):
        assert constrained.num_mixed_verifies > 0 and constrained.num_guided > 0, vars(constrained)
        assert sum(s.num_accepted_tokens for s, _ in added if s.grammar is not None) > 0
    if rows is not None:  # rows written incrementally, each forward equal to a full rewrite
        assert rows.num_forwards > 0 and rows.num_kept > 0 and rows.num_rewritten > 0, vars(rows)
    if oracle is not None:  # every acceptance count, and requests ending inside a block
        metrics = llm.get_metrics()
        assert metrics["num_accepted_tokens_per_pos"][-1] > 0 and oracle.num_cut_inside > 0


def test_failed_generate_leaves_none_of_its_requests_behind(pair, monkeypatch):
    """A step failing inside ``LLM.generate`` (StepError) aborts the call's requests: none stays
    queued or running, every KV block is free, and the next call's output is as if the failed
    call never happened (its requests do not run, and fail, again inside it)."""
    from laguna_dflash.engine.engine import StepError

    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=5, block_size=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 11]
    want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    forward, calls = engine.runner.forward, itertools.count()

    def fails_on_the_third(*args, **kwargs):  # the prefill and a verify run, then one fails
        if next(calls) == 2:
            raise FloatingPointError("injected")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", fails_on_the_third)
    with pytest.raises(StepError, match="injected"):
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert not engine.has_unfinished, "the failed call's requests are still in the engine"
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    steps = engine.timings.num_steps
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)]
    assert got == want[:1]
    # one prefill plus at most 11 one-request verifies: no leftover request ran in between
    assert engine.timings.num_steps - steps <= 12
