"""Context-free grammars as structured outputs (structured_cfg.py: vLLM's
``structured_outputs.grammar``, Lark or GBNF, through llguidance).

Oracles written from the definition: the language of ``root ::= "(" root ")" | "x"`` is
``(^n x )^n``, which no regular expression (so no outlines-core automaton) describes. Before
the ``x`` a token is allowed after a past iff the past's bytes and the token's stay a prefix of
a word of it; after it the rest is forced (``)`` as many times as are open), and llguidance
allows only the first token of the tokenizer's encoding of the forced bytes; stop tokens iff
the past is a word; every token once the past left the language. GBNF and Lark spellings of
it give the same rows. Then the engine: DFlash (the demo pair's trained drafter) equals
target-only token for token under grammars, greedy and seeded, in a batch with free and regex
requests, its outputs parse, drafts are accepted under a grammar; a complete grammar under
ignore_eos ends the request; a grammar pickles (tensor-parallel ranks); and the errors.
"""

from __future__ import annotations

import pickle
import random
import re

import numpy as np
import pytest
import torch

# the demo pair, as the regex backend's tests use it
from test_structured_outputs import DEMO_DRAFT, DEMO_TARGET, PROMPTS, VOCAB

from laguna_dflash import LLM, SamplingParams, StructuredOutputsParams
from laguna_dflash.structured_outputs import (
    StructuredOutputCompiler,
    token_byte_strings,
    unpack_token_bits,
)

NESTED_GBNF = 'root ::= "(" root ")" | "x"'
NESTED_LARK = 'start: "(" start ")" | "x"'
#: a Python function whose expression nests parentheses (GBNF, as llama.cpp writes it)
FUNCTION_GBNF = r'''
root ::= "def " name "(" args? "):\n    return " expr "\n"
name ::= [a-z_]+
args ::= name (", " name)*
expr ::= term (" + " term)*
term ::= name | [0-9]+ | "(" expr ")"
'''
#: nested lists of small numbers (Lark, with a regex terminal)
LIST_LARK = r'''
start: "x = " value
value: NUMBER | "[" value ("," value)* "]"
NUMBER: /[0-9]{1,3}/
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TARGET))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredOutputCompiler(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def spelled(tokenizer):
    return {i: b for b, ids in token_byte_strings(tokenizer, VOCAB).items() for i in ids}


def nested_prefix(text: bytes) -> tuple[bool, bool]:
    """(whether ``text`` is a prefix of a word ``(^n x )^n``, whether it is one)."""
    m = re.fullmatch(rb"(\(*)(x\)*)?", text)
    if m is None:
        return False, False
    opened, closed = len(m.group(1)), (len(m.group(2)) - 1 if m.group(2) else -1)
    return closed <= opened, closed == opened


def nested_oracle(tokenizer, spelled: dict[int, bytes], past: bytes, stops: set[int]) -> set[int]:
    viable, complete = nested_prefix(past)
    if not viable:
        return set(range(VOCAB))
    if complete:
        return set(stops)
    if b"x" in past:  # the rest is forced: its canonical first token
        forced = ")" * (past.count(b"(") - past.count(b")"))
        return {tokenizer.encode(forced, add_special_tokens=False)[0]}
    return {i for i, b in spelled.items() if nested_prefix(past + b)[0]}


def allowed_set(bits: torch.Tensor) -> set[int]:
    return set(unpack_token_bits(bits.view(1, -1), VOCAB)[0].nonzero().flatten().tolist())


# ---- the pieces ---------------------------------------------------------------------------

def test_row_bits_follow_the_nested_oracle(tokenizer, compiler, spelled):
    """Random outputs inside the language, drafts inside and outside it, one and two stop
    tokens: every row is the oracle's set, for the GBNF and the Lark spelling alike."""
    grammars = [compiler.compile(StructuredOutputsParams(grammar=g)) for g in (NESTED_GBNF, NESTED_LARK)]
    rng = random.Random(0)
    for trial in range(30):
        stops = {2} if trial % 2 else {2, 7}
        depth = rng.randrange(1, 6)
        word = b"(" * depth + b"x" + b")" * depth
        outputs: list[int] = []
        while rng.random() < 0.7:
            done = b"".join(spelled[t] for t in outputs)
            path = [i for i, b in spelled.items() if word.startswith(done + b)]
            if not path:
                break
            outputs.append(rng.choice(path))
        drafts = [rng.choice([t for t, b in spelled.items() if b and b[:1] in b"()x"])
                  if rng.random() < 0.7 else rng.randrange(VOCAB) for _ in range(rng.randrange(6))]
        rows_by_grammar = [g.matcher(tuple(stops)).row_bits(outputs, drafts) for g in grammars]
        for rows in rows_by_grammar:
            assert len(rows) == len(drafts) + 1
            for j, bits in enumerate(rows):
                past = outputs + drafts[:j]
                walked = b"".join(spelled.get(t, b"\xff") for t in past)  # a special token: off
                assert allowed_set(bits) == nested_oracle(tokenizer, spelled, walked, stops), (trial, j, past)


def test_a_matcher_gives_drafts_back(tokenizer, compiler, spelled):
    """Rows after drafts, then the outputs grown by some of them: the state is the outputs',
    never the drafts' (rollback), and guided drafts' rows are the verify's."""
    grammar = compiler.compile(StructuredOutputsParams(grammar=NESTED_GBNF))
    ids = {b: i for i, b in spelled.items()}
    o, x, c, cc = ids[b"("], ids[b"x"], ids[b")"], ids[b"))"]
    matcher = grammar.matcher((2,))
    matcher.row_bits([o], [o, x, c])
    assert allowed_set(matcher.row_bits([o, o], [])[0]) == nested_oracle(tokenizer, spelled, b"((", {2})
    drafts = matcher.guided_drafts([o, o], np.array([[c, x], [c, cc], [c, o], [x, o]]))
    assert drafts == [x, cc, c, x]  # x, then "))" (forced), then only the stop token: the likeliest
    rows = matcher.row_bits([o, o], drafts)
    fresh = grammar.matcher((2,)).row_bits([o, o], drafts)
    assert all(torch.equal(a, b) for a, b in zip(rows, fresh))
    assert allowed_set(rows[2]) == {2}  # "((x))": complete, only the stop token
    assert allowed_set(rows[3]) == set(range(VOCAB))  # past the refused draft: left


def test_the_stop_tokens_are_the_engines(compiler, spelled):
    """llguidance allows its EOS where the grammar accepts; here the request's stop tokens are
    allowed instead (none under ignore_eos, 7 for a stop_token_ids request)."""
    grammar = compiler.compile(StructuredOutputsParams(grammar='start: "ab" | "abc"'))
    ids = {b: i for i, b in spelled.items()}
    past = [ids[b"a"], ids[b"b"]]
    c_tokens = {i for i, b in spelled.items() if b == b"c"}
    for stops in ((), (7,), (2,)):
        matcher = grammar.matcher(stops)
        assert allowed_set(matcher.row_bits(past, [])[0]) == c_tokens | set(stops)
        assert not matcher.allows_nothing(past)
        assert matcher.allows_nothing(past + [ids[b"c"]]) == (not stops)


@pytest.mark.parametrize("vocab", [VOCAB - 96, VOCAB + 104])
def test_a_vocabulary_other_than_the_tokenizers(tokenizer, spelled, vocab):
    """A model whose vocabulary leaves the tokenizer's last ids out (or pads past them): the
    rows hold only the model's ids, the others as with the whole vocabulary."""
    params = StructuredOutputsParams(grammar="start: /[a-z]+/")
    rows = StructuredOutputCompiler(tokenizer, vocab).compile(params).matcher((2,)).row_bits([], [])
    got = set(unpack_token_bits(rows[0].view(1, -1), vocab)[0].nonzero().flatten().tolist())
    assert got == {i for i, b in spelled.items() if i < vocab and re.fullmatch(rb"[a-z]+", b)}


def test_grammar_pickles(compiler, spelled):
    grammar = compiler.compile(StructuredOutputsParams(grammar=LIST_LARK))
    copy = pickle.loads(pickle.dumps(grammar))
    past = [i for i, b in spelled.items() if b == b"x"][:1]
    for g in (grammar, copy):
        assert g.matcher((2,)).row_bits([], past)[0].any()
    assert all(torch.equal(a, b) for a, b in zip(grammar.matcher((2,)).row_bits([], past),
                                                    copy.matcher((2,)).row_bits([], past)))


@pytest.mark.parametrize("grammar, message", [
    ('root ::= "a" missing', "grammar is not a valid Lark or GBNF grammar"),
    ("start: (", "grammar is not a valid Lark or GBNF grammar"),
    ("this is no grammar", "grammar is not a valid Lark or GBNF grammar"),
])
def test_compile_errors(compiler, grammar, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(StructuredOutputsParams(grammar=grammar))


def test_a_slow_tokenizer_says_so(tokenizer):
    class Slow:  # a tokenizer without a tokenizer.json (no Rust backend)
        eos_token_id = 2

    with pytest.raises(ValueError, match="needs a fast tokenizer"):
        StructuredOutputCompiler(Slow(), VOCAB).compile(StructuredOutputsParams(grammar=NESTED_LARK))


# ---- the engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_only():
    return LLM(str(DEMO_TARGET))


@pytest.fixture(scope="module")
def dflash():
    return LLM(str(DEMO_TARGET), draft=str(DEMO_DRAFT), num_speculative_tokens=7)


def parses_function(text: str) -> bool:
    """Whether ``text`` is a word of FUNCTION_GBNF (a recursive-descent check)."""
    m = re.fullmatch(r"def [a-z_]+\((?:[a-z_]+(?:, [a-z_]+)*)?\):\n    return (.*)\n", text, re.S)
    if m is None:
        return False
    expr, pos = m.group(1), 0

    def parse_expr() -> bool:
        nonlocal pos
        if not parse_term():
            return False
        while expr.startswith(" + ", pos):
            pos += 3
            if not parse_term():
                return False
        return True

    def parse_term() -> bool:
        nonlocal pos
        if expr.startswith("(", pos):
            pos += 1
            if not parse_expr() or not expr.startswith(")", pos):
                return False
            pos += 1
            return True
        t = re.match(r"[a-z_]+|[0-9]+", expr[pos:])
        if t is None:
            return False
        pos += t.end()
        return True

    return parse_expr() and pos == len(expr)


def grammar_batch(temperature: float, seed: int | None) -> list[SamplingParams]:
    base = dict(temperature=temperature, seed=seed, max_tokens=40)
    return [SamplingParams(**base, structured_outputs={"grammar": FUNCTION_GBNF}),
            SamplingParams(**base),
            SamplingParams(**base, structured_outputs={"grammar": LIST_LARK}),
            SamplingParams(**base, structured_outputs={"grammar": NESTED_LARK}),
            SamplingParams(**base, structured_outputs={"regex": r"[a-z]{1,8}"})]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 11)])
def test_dflash_equals_target_only_with_grammars(target_only, dflash, temperature, seed):
    params = grammar_batch(temperature, seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    before = dflash.get_metrics()["num_accepted_tokens"]
    base = target_only.generate(prompts, params, use_tqdm=False)
    spec = dflash.generate(prompts, params, use_tqdm=False)
    for b, s in zip(base, spec):
        assert s.token_ids == b.token_ids
    function, _, lists, nested, _ = spec
    if function.finish_reason == "stop":
        assert parses_function(function.text), function.text
    assert lists.text.startswith("x = ")
    if lists.finish_reason == "stop":
        assert re.fullmatch(r"x = [\[\],0-9]+", lists.text) and lists.text.count("[") == lists.text.count("]")
    assert nested_prefix(nested.text.encode())[nested.finish_reason == "stop"], nested.text
    if temperature == 0.0:  # drafts were accepted inside the grammars too
        assert dflash.get_metrics()["num_accepted_tokens"] > before
        assert function.finish_reason == "stop"


def test_every_request_alone_gives_the_same_tokens(dflash):
    params = grammar_batch(0.0, None)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    batched = dflash.generate(prompts, params, use_tqdm=False)
    for prompt, p, b in zip(prompts, params, batched):
        assert dflash.generate([prompt], p, use_tqdm=False)[0].token_ids == b.token_ids


def test_a_complete_grammar_under_ignore_eos_ends_the_request(target_only, dflash):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            structured_outputs={"grammar": 'root ::= "(" "x"? ")" | "yes"'})
    base, spec = (llm.generate(PROMPTS[:2], params, use_tqdm=False) for llm in (target_only, dflash))
    for b, s in zip(base, spec):
        assert s.token_ids == b.token_ids
        assert s.finish_reason == "stop" and s.text in ("()", "(x)", "yes"), s.text


def test_a_model_without_a_tokenizer_says_so(tmp_path):
    import dflash_fixtures as df

    llm = LLM(str(df.make_tiny_laguna_target(tmp_path / "t")))
    with pytest.raises(ValueError, match="structured_outputs: .* has no tokenizer"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(
            structured_outputs=StructuredOutputsParams(grammar=NESTED_LARK)), use_tqdm=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 5)])
def test_cuda_dflash_equals_target_only_with_grammars(temperature, seed):
    """On the GPU (CUDA graphs, pinned uploads, the drafts' host copy): the same."""
    params = grammar_batch(temperature, seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    spec = LLM(str(DEMO_TARGET), draft=str(DEMO_DRAFT), num_speculative_tokens=7, device="cuda")
    out = spec.generate(prompts, params, use_tqdm=False)
    base = LLM(str(DEMO_TARGET), device="cuda").generate(prompts, params, use_tqdm=False)
    for b, s in zip(base, out):
        assert s.token_ids == b.token_ids
    assert nested_prefix(out[3].text.encode())[0], out[3].text
