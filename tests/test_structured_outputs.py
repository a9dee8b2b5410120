"""vLLM's structured outputs offline (structured_outputs.py, engine/penalties.py): the output
matches a JSON schema, a regex or one of a list of strings, greedy and sampled, and DFlash
stays lossless with a constraint.

Oracles written from the definition, not from the automaton: the vocabulary's byte strings
spell what the tokenizer encodes; a token is allowed after a past iff the past's bytes and the
token's are a prefix of some choice (the choice oracle), or iff Python's ``regex`` module finds
the text a partial match of the pattern (the regex oracle, ASCII patterns); stop tokens only
where the past completes a match. Then the engine: target-only greedy picks the raw logits'
argmax among the allowed tokens at every position; DFlash (the demo pair's trained drafter, so
drafts are accepted and refused mid-block) equals target-only token for token in batches mixing
constrained and free requests, greedy and seeded sampling; and the errors.
"""

from __future__ import annotations

import json
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import regex as partial_regex
import torch

from laguna_dflash import LLM, SamplingParams, StructuredOutputsParams
from laguna_dflash.structured_outputs import (
    MAX_JSON_OBJECT_DEPTH,
    GrammarMatcher,
    StructuredOutputCompiler,
    json_object_regex,
    pack_token_bits,
    token_byte_strings,
    unpack_token_bits,
)

DEMO_TARGET = Path(__file__).resolve().parents[1] / "assets" / "demo" / "target"
DEMO_DRAFT = DEMO_TARGET.parent / "draft"
VOCAB = 4096  # the demo target's
FUNCTION_REGEX = r"def [a-z_]{1,16}\(\):\n    return [0-9]{1,5}\n"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"]}
PROMPTS = ["def add(a, b):\n", "import os\n", "class Point:\n"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TARGET))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredOutputCompiler(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def target_only():
    return LLM(str(DEMO_TARGET), max_logprobs=-1)


@pytest.fixture(scope="module")
def dflash():
    return LLM(str(DEMO_TARGET), draft=str(DEMO_DRAFT), num_speculative_tokens=7)


# ---- the pieces ---------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, VOCAB])
def test_token_bits_round_trip(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for _ in range(5):
        chosen = torch.rand(vocab, generator=gen) < 0.5
        chosen[vocab - 1] = True  # the last word's top bit (bit 31 where vocab % 32 == 0)
        bits = pack_token_bits(chosen.nonzero().flatten(), vocab)
        assert bits.dtype == torch.int32 and bits.shape == ((vocab + 31) // 32,)
        assert torch.equal(unpack_token_bits(bits.view(1, -1), vocab)[0], chosen)


def test_byte_strings_spell_what_the_tokenizer_encodes(tokenizer):
    spelled = {i: b for b, ids in token_byte_strings(tokenizer, VOCAB).items() for i in ids}
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special}  # <|file|> too
    assert not special & set(spelled)
    assert len(spelled) == VOCAB - len(special)  # every ordinary token, each once
    for text in ["def f(x):\n    return x  # ok", "naïve café: 3 € — ✓", "\t\ttabs\r\n", "日本語"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(spelled[i] for i in ids) == text.encode("utf-8"), text


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": "yes"}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"regex": 5}, "regex must be a string"),
    ({"grammar": "  "}, "grammar must be a Lark or GBNF grammar"),
    ({"grammar": 5}, "grammar must be a Lark or GBNF grammar"),
    ({"grammar": "start: 'a'", "regex": "a"}, "exactly one of json, regex, choice, json_object and grammar"),
    ({"regex": "a", "structural_tag": "{}"}, "structural_tag .*is not supported"),
])
def test_params_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_params_from_a_request_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"], "backend": "xgrammar"})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert params.has_penalties  # the logits are processed: no int8 greedy shortcut
    with pytest.raises(ValueError, match=r"unknown fields \['choices'\]"):
        SamplingParams(structured_outputs={"choices": ["a"]})


def test_json_object_regex_takes_json_objects_nested_once():
    spaced = json_object_regex(MAX_JSON_OBJECT_DEPTH, "[ ]?")
    compact = json_object_regex(MAX_JSON_OBJECT_DEPTH, "")
    fits = [{}, {"a": 1}, {"a": -0.5e3, "b": "x\\y\"z\u00e9", "c": [1, "2", None, True]},
            {"k": {"n": 1, "m": "s"}, "l": [None, 1.25], "e": {}, "f": []}, {"": ""}]
    for value in fits:
        assert re.fullmatch(spaced, json.dumps(value, ensure_ascii=True)), value
        assert re.fullmatch(compact, json.dumps(value, separators=(",", ":"))), value
        assert not re.fullmatch(compact, json.dumps(value, indent=1)) or value == {}
    too_deep = [{"a": {"b": {}}}, {"a": [[]]}, {"a": [{"x": False}]}]
    not_objects = ["[]", "1", '"s"', "null", '{"a":}', '{"a":1,}', "{'a': 1}", '{"a": 01}',
                   r'{"a": "\u12"}', r'{"a": "\x"}', '{"a":1}{}']
    for text in [json.dumps(v) for v in too_deep] + not_objects:
        assert not re.fullmatch(spaced, text), text


def test_compile_errors(compiler):
    with pytest.raises(ValueError, match="cannot be compiled"):
        compiler.compile(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="StructuredOutputsParams.json: .*nonsense"):
        compiler.compile(StructuredOutputsParams(json={"type": "nonsense"}))
    with pytest.raises(ValueError, match="regex repeats a piece 5000 times, over the 4096"):
        compiler.compile(StructuredOutputsParams(regex="[ab]{2,5000}"))
    with pytest.raises(ValueError, match="json repeats a piece 9999999 times"):
        compiler.compile(StructuredOutputsParams(json={"type": "array", "minItems": 10**7}))
    compiler.compile(StructuredOutputsParams(regex=r"\{[0-9]{1,4096}\}"))  # at the cap; braces literal


def choice_oracle(spelled: dict[int, bytes], choices: list[str], past: bytes, stops: set[int]) -> set[int]:
    """Tokens allowed after ``past``: those keeping it a prefix of a choice, and the stop
    tokens once it is one; everything once it is none (past the constraint)."""
    targets = [c.encode() for c in choices]
    if not any(t.startswith(past) for t in targets):
        return set(range(VOCAB))
    out = {i for i, b in spelled.items() if any(t.startswith(past + b) for t in targets)}
    return out | stops if past in targets else out


def test_row_bits_follow_the_choice_oracle(tokenizer, compiler):
    choices = ["yes", "no", "nope", "maybe later", "naïve café", "return 42", "return 42.5"]
    stops = {2, 7}
    grammar = compiler.compile(StructuredOutputsParams(choice=choices))
    spelled = {i: b for b, ids in token_byte_strings(tokenizer, VOCAB).items() for i in ids}
    rng = random.Random(0)
    for trial in range(40):
        choice = rng.choice(choices).encode()
        path = [i for i, b in spelled.items() if choice.startswith(b)]  # first tokens of it
        outputs: list[int] = []
        while outputs == [] or (rng.random() < 0.5 and path):
            done = b"".join(spelled[t] for t in outputs)
            path = [i for i, b in spelled.items() if choice.startswith(done + b)]
            if path:
                outputs.append(rng.choice(path))
        drafts = [rng.randrange(VOCAB) if rng.random() < 0.3 else rng.choice(list(spelled))
                  for _ in range(rng.randrange(5))]
        if trial % 3 == 0:  # the drafts spell the rest of the choice: all rows inside it
            rest = choice[len(b"".join(spelled[t] for t in outputs)):]
            drafts = tokenizer.encode(rest.decode("utf-8", "ignore"), add_special_tokens=False)[:4]
        matcher = GrammarMatcher(grammar, tuple(stops))
        rows = matcher.row_bits(outputs, drafts)
        assert len(rows) == len(drafts) + 1
        for j, bits in enumerate(rows):
            past = outputs + drafts[:j]
            walked = b"".join(spelled.get(t, b"\xff\xff") for t in past)  # a special token: off
            expected = choice_oracle(spelled, choices, walked, stops)
            got = set(unpack_token_bits(bits.view(1, -1), VOCAB)[0].nonzero().flatten().tolist())
            assert got == expected, (trial, j, past)


def test_grammar_pickles(compiler):
    grammar = compiler.compile(StructuredOutputsParams(regex=FUNCTION_REGEX))
    copy = pickle.loads(pickle.dumps(grammar))
    for state in (grammar.initial_state, grammar.next_state(grammar.initial_state, 0) or grammar.initial_state):
        assert torch.equal(copy.allowed_bits(state), grammar.allowed_bits(state))


# ---- the engine ---------------------------------------------------------------------------

def regex_allowed(tokenizer, pattern: str, past: list[int]) -> set[int]:
    """Tokens whose text after ``past``'s keeps it a partial match of ASCII ``pattern``
    (Python's ``regex``), plus EOS (2) where ``past`` fully matches."""
    spelled = {i: b for b, ids in token_byte_strings(tokenizer, VOCAB).items() for i in ids}
    text = b"".join(spelled[t] for t in past).decode("latin-1")
    out = {i for i, b in spelled.items()
           if partial_regex.fullmatch(pattern, text + b.decode("latin-1"), partial=True)}
    return out | {2} if partial_regex.fullmatch(pattern, text) else out


def test_target_only_greedy_is_the_masked_argmax(tokenizer, target_only):
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=VOCAB,
                            structured_outputs=StructuredOutputsParams(regex=FUNCTION_REGEX))
    out = target_only.generate(PROMPTS[:2], params, use_tqdm=False)
    for o in out:
        assert o.finish_reason == "stop" and o.token_ids[-1] == 2
        assert re.fullmatch(FUNCTION_REGEX, o.text), o.text
        for n, (token, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            allowed = regex_allowed(tokenizer, FUNCTION_REGEX, o.token_ids[:n])
            assert token in allowed
            best = max(allowed, key=lambda t: float(entry[t]))
            assert float(entry[token]) == float(entry[best]), (n, token, best)


def mixed_batch(temperature: float, seed: int | None) -> list[SamplingParams]:
    """Constrained and free requests in one batch."""
    base = dict(temperature=temperature, seed=seed, max_tokens=48)
    return [
        SamplingParams(**base, structured_outputs=StructuredOutputsParams(regex=FUNCTION_REGEX)),
        SamplingParams(**base),
        SamplingParams(**base, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(**base, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe later"])),
        SamplingParams(**base, bad_words=["return"], structured_outputs={"json_object": True}),
    ]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 11)])
def test_dflash_equals_target_only_with_constraints(target_only, dflash, temperature, seed):
    params = mixed_batch(temperature, seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    base = target_only.generate(prompts, params, use_tqdm=False)
    spec = dflash.generate(prompts, params, use_tqdm=False)
    for b, s in zip(base, spec):
        assert s.token_ids == b.token_ids
    if temperature == 0.0:  # the drafter was right some of the time, inside constraints too
        assert dflash.engine.spec_stats.num_accepted_tokens > 0
    regex_out, _, json_out, choice_out, object_out = spec
    if regex_out.finish_reason == "stop":
        assert re.fullmatch(FUNCTION_REGEX, regex_out.text), regex_out.text
    if json_out.finish_reason == "stop":
        value = json.loads(json_out.text)
        assert isinstance(value["name"], str) and len(value["name"]) <= 10
        assert isinstance(value["age"], int) and value["age"] >= 0
        assert set(value["tags"]) <= {"x", "y"} and len(value["tags"]) <= 2
    assert choice_out.finish_reason == "stop" and choice_out.text in ("yes", "no", "maybe later")
    assert object_out.text.startswith("{")
    if object_out.finish_reason == "stop":
        assert isinstance(json.loads(object_out.text), dict)


def test_every_request_of_a_batch_alone_gives_the_same_tokens(dflash):
    params = mixed_batch(0.0, None)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    batched = dflash.generate(prompts, params, use_tqdm=False)
    for prompt, p, b in zip(prompts, params, batched):
        assert dflash.generate([prompt], p, use_tqdm=False)[0].token_ids == b.token_ids


def test_engine_errors(tokenizer, compiler, target_only):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="structured_grammar"):
        target_only.engine.add_request([5, 6], params)
    other = StructuredOutputCompiler(tokenizer, VOCAB + 32).compile(StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="vocabulary of 4128 tokens, and this model has 4096"):
        target_only.engine.add_request([5, 6], SamplingParams(structured_outputs=params.structured_outputs,
                                                              structured_grammar=other))
    assert not target_only.engine.has_unfinished


def test_a_model_without_a_tokenizer_says_so(tmp_path):
    import dflash_fixtures as df

    llm = LLM(str(df.make_tiny_laguna_target(tmp_path / "t")))
    with pytest.raises(ValueError, match="structured_outputs: .* has no tokenizer"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 5)])
def test_cuda_dflash_equals_target_only_with_constraints(temperature, seed):
    """On the GPU (CUDA graphs, pinned uploads, the drafts' host copy): the same."""
    spec = LLM(str(DEMO_TARGET), draft=str(DEMO_DRAFT), num_speculative_tokens=7, device="cuda")
    params = mixed_batch(temperature, seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    out = spec.generate(prompts, params, use_tqdm=False)
    base = LLM(str(DEMO_TARGET), device="cuda").generate(prompts, params, use_tqdm=False)
    for b, s in zip(base, out):
        assert s.token_ids == b.token_ids
    assert out[3].text in ("yes", "no", "maybe later")


def test_min_tokens_yields_to_a_complete_constraint(target_only, dflash):
    """min_tokens bans the stop tokens while the constraint could go on; once the constraint
    allows only stop tokens (the output is complete) they stay allowed."""
    cases = [({"choice": ["yes", "no"]}, "yes|no", 0), ({"regex": ""}, "", 0), ({"regex": "(ab)+"}, "(ab)+", 6)]
    for fields, pattern, at_least in cases:
        params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, structured_outputs=fields)
        base, spec = (llm.generate(PROMPTS[:2], params, use_tqdm=False) for llm in (target_only, dflash))
        for b, s in zip(base, spec):
            assert s.token_ids == b.token_ids
            assert 0 not in s.token_ids  # no all -inf row (token 0 is what one would give)
            if s.finish_reason == "stop":
                assert re.fullmatch(pattern, s.text), (fields, s.text)
                assert len(s.token_ids) - 1 >= at_least


def test_a_complete_constraint_under_ignore_eos_ends_the_request(target_only, dflash):
    """ignore_eos takes EOS out of the stop tokens, so a complete choice allows no token at all:
    the request ends there ("stop", its last token's text kept), not on an all -inf row's
    token 0 with the constraint gone. A regex that can go on runs to max_tokens inside it; a
    stop_token_ids token still ends one (its text left out). Greedy and seeded, DFlash equal
    to target-only."""
    for temperature, seed in ((0.0, None), (0.9, 3)):
        base = dict(temperature=temperature, seed=seed, max_tokens=12, ignore_eos=True)
        params = [SamplingParams(**base, structured_outputs={"choice": ["yes", "no"]}),
                  SamplingParams(**base, structured_outputs={"regex": "(ab)+"}),
                  SamplingParams(**base, stop_token_ids=[2], structured_outputs={"choice": ["yes", "no"]})]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
        ref, spec = (llm.generate(prompts, params, use_tqdm=False) for llm in (target_only, dflash))
        for b, s in zip(ref, spec):
            assert s.token_ids == b.token_ids and s.text == b.text
            assert 0 not in s.token_ids
        choice, pairs, stopped = spec
        assert choice.finish_reason == "stop" and choice.text in ("yes", "no"), choice
        assert choice.stop_reason is None
        assert pairs.finish_reason == "length" and len(pairs.token_ids) == 12
        assert re.fullmatch("(ab)+a?", pairs.text), pairs.text
        assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == 2 and stopped.stop_reason == 2
        assert stopped.text in ("yes", "no")


# ---- guided drafts ------------------------------------------------------------------------

def test_guided_drafts_take_the_first_allowed_candidate(tokenizer, compiler):
    grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    spelled = {b: ids[0] for b, ids in token_byte_strings(tokenizer, VOCAB).items()}
    y, e, s, n, o, x = (spelled[c] for c in (b"y", b"e", b"s", b"n", b"o", b"x"))
    matcher = GrammarMatcher(grammar, (2,))
    cands = np.array([[x, y, n], [x, e, o], [s, x, e], [x, 5, 2], [y, n, x]])
    # y (x refused), e, s, then the stop token (final: "yes"), then past the stop: the likeliest
    assert matcher.guided_drafts([], cands) == [y, e, s, 2, y]
    assert matcher.drafted(0, 5) == [y, e, s, 2, y] and matcher.drafted(0, 4) is None
    assert matcher.drafted(1, 5) is None
    # nothing allowed at a position: its likeliest, and the rest unguided (the state is gone)
    assert matcher.guided_drafts([n], np.array([[x, y], [o, x]])) == [x, o]


def test_a_verify_reads_guided_drafts_from_the_host(tokenizer, compiler):
    """penalized_rows needs no device drafts for requests whose drafts were guided."""
    from laguna_dflash.engine.penalties import penalized_rows
    from laguna_dflash.engine.sequence import Sequence

    grammar = compiler.compile(StructuredOutputsParams(regex=FUNCTION_REGEX))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=FUNCTION_REGEX),
                            structured_grammar=grammar)
    seq = Sequence(0, [5, 6], params, eos_token_ids=(2,))
    seq.grammar = GrammarMatcher(grammar, (2,))
    first = tokenizer.encode("def", add_special_tokens=False)[0]
    drafts = seq.grammar.guided_drafts([], np.array([[first, 9], [7, 8]]))
    rows = penalized_rows(torch.zeros(3, VOCAB), [seq], 3, drafts=None)[0]  # no device drafts given
    expected = seq.grammar.row_bits([], drafts)
    for row, bits in zip(rows, expected):
        assert torch.equal(row > float("-inf"), unpack_token_bits(bits.view(1, -1), VOCAB)[0])


def test_guided_drafts_raise_acceptance_under_a_schema(dflash, monkeypatch):
    """Drafts chosen inside the constraint are accepted more often than the drafter's argmax
    (which the constraint often refuses), and the outputs stay the same tokens."""
    import laguna_dflash.engine.spec_decode as spec_decode

    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA))

    def run() -> tuple[float, list]:
        before = dflash.get_metrics()
        out = dflash.generate(PROMPTS, params, use_tqdm=False)
        after = dflash.get_metrics()
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        return 1 + accepted / (after["num_drafts"] - before["num_drafts"]), [o.token_ids for o in out]

    guided, guided_tokens = run()
    monkeypatch.setattr(spec_decode, "num_draft_candidates", 0)
    argmax, argmax_tokens = run()
    assert guided_tokens == argmax_tokens
    assert guided > argmax + 0.3, (guided, argmax)
