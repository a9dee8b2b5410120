"""Stop strings and stop tokens in the offline API (``LLM.generate``), as vLLM's: the text ends
before the first stop string found (after it with ``include_stop_str_in_output``), the request
stops at the token that completed it, with and without DFlash; a stop token's text is left out."""

from __future__ import annotations

import pytest

from laguna_dflash import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    target, draft = df.make_served_pair(tmp_path_factory.mktemp("offline-stop"), K + 1, distill_steps=200)
    return LLM(str(target), block_size=8), LLM(str(target), draft=str(draft), block_size=8)


PROMPTS = ["def quick", "import os\nimport", "class Tree:\n    def", "for i in range("]


def _greedy(llm: LLM, **kw) -> list:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw)
    return llm.generate(PROMPTS, params)


def test_stop_strings_end_text_and_tokens_as_in_vllm(pair):
    base, spec = pair
    full = _greedy(base)
    checked = 0
    for out in full:
        text = out.text  # random weights: bytes that are often not UTF-8 (U+FFFD)
        starts = [i for i in range(len(text) // 3, len(text) - 2)
                  if "\ufffd" not in text[i : i + 3] and text[i : i + 3].strip()]
        if not starts:
            continue
        stop = text[starts[0] : starts[0] + 3]  # from the middle: most span two tokens
        cut = text.index(stop)
        stopped = []
        for llm in (base, spec):
            got = llm.generate([out.prompt], SamplingParams(temperature=0, max_tokens=40,
                                                            ignore_eos=True, stop=[stop, "\x00"],
                                                            logprobs=1))[0]
            assert (got.text, got.finish_reason, got.stop_reason) == (text[:cut], "stop", stop)
            # the request stopped where its text showed the stop string: a prefix of the full
            # output, the same with DFlash (no tokens of a verify past it)
            n = len(got.token_ids)
            assert got.token_ids == out.token_ids[:n] and stop in base.decode(got.token_ids)
            assert len(got.logprobs) == n < len(out.token_ids)
            stopped.append(got.token_ids)
            kept = llm.generate([out.prompt], SamplingParams(
                temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                include_stop_str_in_output=True))[0]
            assert kept.text == text[: cut + len(stop)] and kept.token_ids == got.token_ids
        assert stopped[0] == stopped[1]
        checked += 1
    assert checked >= 2
    # a stop string that never appears changes nothing
    none = _greedy(spec, stop=["\x00\x01"])
    assert [(o.text, o.token_ids, o.finish_reason) for o in none] == [
        (o.text, o.token_ids, o.finish_reason) for o in full]


def test_stop_token_text_is_left_out_and_named(pair):
    base, spec = pair
    out = _greedy(base)[0]
    stop_id = out.token_ids[5]
    first = out.token_ids.index(stop_id)
    for llm in (base, spec):
        got = llm.generate([out.prompt], SamplingParams(temperature=0, max_tokens=40,
                                                        stop_token_ids=[stop_id]))[0]
        assert got.token_ids == out.token_ids[: first + 1] and got.stop_reason == stop_id
        assert got.finish_reason == "stop" and got.text == base.decode(out.token_ids[:first])


def test_stop_field_errors(tmp_path):
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=5)
    assert SamplingParams(stop="x").stop == ("x",)
    from laguna_dflash.models.random_init import write_random_pair

    target, _ = write_random_pair(tmp_path)  # no tokenizer
    with pytest.raises(ValueError, match="SamplingParams.stop: .*no tokenizer"):
        LLM(str(target)).generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(stop="x"))


def test_a_stop_string_in_the_tail_held_to_the_end_stops_the_request():
    """The demo target's token 3947 decodes to a space and the first byte of an unfinished
    character: its text is held back (it ends in U+FFFD) until the request ends, and only the
    final flush shows the stop string " ". The text was cut there, but the output said
    finish_reason "length"; it says "stop" and names the string, as the server does."""
    from laguna_dflash.demo import demo_pair

    target, _ = demo_pair()
    llm = LLM(target, max_model_len=256)
    assert llm.tokenizer.decode([3947]) == " \ufffd"
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={3947: 100.0})
    plain = llm.generate(["def f(x):"], SamplingParams(**params))[0]
    assert plain.token_ids == [3947] * 3 and plain.finish_reason == "length"
    got = llm.generate(["def f(x):"], SamplingParams(**params, stop=[" "]))[0]
    assert (got.text, got.finish_reason, got.stop_reason) == ("", "stop", " ")
