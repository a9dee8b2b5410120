"""vLLM's ``num_speculative_tokens_per_batch_size``: K by the step's batch size
(engine/adaptive_k.BatchSizeK). Checked: each step drafts the scheduled K for its batch, output
equals target-only (lossless at any K), and bad schedules fail at start-up naming the key."""

from __future__ import annotations

import pytest

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import SpeculativeConfig, k_schedule

BLOCK_SIZE = 6
K = BLOCK_SIZE - 1
KEY = "num_speculative_tokens_per_batch_size"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("k-schedule"), BLOCK_SIZE)


def _spec(pair, schedule, **kw) -> LLM:
    target, draft = pair
    return LLM(target, speculative_config={"method": "dflash", "model": draft,
                                           "num_speculative_tokens": K, KEY: schedule},
               block_size=4, max_num_seqs=8, **kw)


def _shrinking_batch(num_requests: int, first_len: int, step: int) -> tuple[list, list]:
    """Prompts of different lengths and greedy max_tokens ``first_len + step * i``: the batch
    shrinks one request at a time as they finish, crossing a schedule's ranges."""
    prompts = [[(7 * i + j) % 50 for j in range(3 + i)] for i in range(num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=first_len + step * i, ignore_eos=True)
              for i in range(num_requests)]
    return prompts, params


def _target_only(pair, prompts: list, params: list) -> list[list[int]]:
    outs = LLM(pair[0], block_size=4, max_num_seqs=8).generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.token_ids for o in outs]


def test_each_step_drafts_its_batch_sizes_k_and_the_output_is_the_targets(pair):
    schedule = [[4, 8, 0], [1, 1, K], [2, 3, 2]]  # any order
    llm = _spec(pair, schedule)
    steps = []  # (batch size, K) of every decode step, as the engine ran it
    spec_decode, decode = llm.engine._spec_decode, llm.engine._decode
    llm.engine._spec_decode = lambda seqs, k, *a: steps.append((len(seqs), k)) or spec_decode(seqs, k, *a)
    llm.engine._decode = lambda seqs, *a: steps.append((len(seqs), 0)) or decode(seqs, *a)
    prompts, params = _shrinking_batch(6, 6, 5)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == _target_only(pair, prompts, params)
    expected = {b: k for lo, hi, k in schedule for b in range(lo, hi + 1)}
    assert steps and all(k == expected[b] for b, k in steps), steps
    assert {k for _, k in steps} == {0, 2, K}, steps  # every range was used
    assert sum(o.metrics["num_drafts"] for o in got) > 0


def test_the_schedule_reaches_serve_and_warms_every_level(pair):
    """``--speculative-config`` carries it to the engine (and /server_info); the warm-up drafts
    at each scheduled K, so a level first used while serving captures nothing new."""
    import json

    from laguna_dflash.cli import build_parser
    from laguna_dflash.server.args import resolve_server_config

    target, draft = pair
    spec = json.dumps({"method": "dflash", "model": str(draft), KEY: [[1, 2, 3], [3, 256, 1]]})
    config = resolve_server_config(build_parser().parse_args(
        ["serve", "--model", str(target), "--speculative-config", spec]))
    assert config.speculative.config.num_speculative_tokens_per_batch_size == ((1, 2, 3), (3, 256, 1))
    assert config.describe()[KEY] == [[1, 2, 3], [3, 256, 1]]
    llm = _spec(pair, [[1, 2, 3], [3, 8, 1]])
    used = []
    spec_decode = llm.engine._spec_decode
    llm.engine._spec_decode = lambda seqs, k, *a: used.append(k) or spec_decode(seqs, k, *a)
    llm.engine.warmup()
    assert {1, 3} <= set(used)
    assert llm.engine.k_policy.choose(1) == 3 and llm.engine.k_policy.choose(8) == 1


@pytest.mark.parametrize("schedule, needle", [
    ([], "non-empty list"),
    ([[1, 8]], "three integers"),
    ([[1, 8, "2"]], "three integers"),
    ([[1, 8, True]], "three integers"),
    ([[0, 8, 2]], "1 <= first <= last"),
    ([[5, 4, 2]], "1 <= first <= last"),
    ([[1, 8, -1]], "K >= 0"),
    ([[1, 4, 2], [4, 8, 0]], r"ranges \[1, 4\] and \[4, 8\] overlap"),
])
def test_bad_schedules_name_the_key(schedule, needle):
    with pytest.raises(ValueError, match=needle) as info:
        k_schedule(schedule, KEY)
    assert KEY in str(info.value)


def test_the_engine_checks_the_schedule_against_k_and_max_num_seqs(pair):
    with pytest.raises(ValueError, match=rf"{KEY}: \[1, 8, 6\] drafts more than num_speculative_tokens=5"):
        _spec(pair, [[1, 8, 6]])
    with pytest.raises(ValueError, match=r"no range holds batch size 3; .*max_num_seqs=8 .*add \[3, 8, 0\]"):
        _spec(pair, [[1, 2, 4]])
    with pytest.raises(ValueError, match=r"no range holds batch size 3"):  # a gap inside
        _spec(pair, [[1, 2, 4], [4, 8, 0]])
    with pytest.raises(ValueError, match="adaptive_k .* give one"):
        SpeculativeConfig(draft="d", adaptive=True, num_speculative_tokens_per_batch_size=((1, 8, 2),))
    with pytest.raises(ValueError, match=f"speculative_config= {KEY}: each range"):
        _spec(pair, [[1, 8]])


def test_generate_and_bench_take_the_schedule_from_speculative_config(pair, capsys):
    """``generate`` / ``bench`` read ``--speculative-config``'s drafter and K and used to drop
    its schedule silently (the key is one this engine reads, so not even a warning): a batch-1
    schedule of K = 2 now drafts 2 tokens a step out of the drafter's 5; bench's speculative
    engine gets it too."""
    import json

    from laguna_dflash import bench
    from laguna_dflash.cli import main

    target, draft = pair
    spec = json.dumps({"method": "dflash", "model": str(draft), KEY: [[1, 1, 2]]})
    assert main(["generate", "--model", str(target), "--speculative-config", spec, "--prompt-ids",
                 "1,2,3", "--max-new-tokens", "12", "--json", "--no-compare"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_drafts"] > 0 and out["num_draft_tokens"] == 2 * out["num_drafts"]
    seen = []
    real = bench.LLM

    def spy(*args, **kw):
        seen.append(kw.get(KEY))
        return real(*args, **kw)

    bench.LLM = spy
    try:
        spec = json.dumps({"method": "dflash", "model": str(draft), KEY: [[1, 256, 1]]})
        assert main(["bench", "--model", str(target), "--speculative-config", spec, "--prompts",
                     str(_prompts_file(pair)), "--max-new-tokens", "4", "--json"]) == 0
    finally:
        bench.LLM = real
    assert ((1, 256, 1),) in seen or [[1, 256, 1]] in seen, seen
    assert json.loads(capsys.readouterr().out)["num_speculative_tokens"] == K


def _prompts_file(pair) -> object:
    import json
    from pathlib import Path

    path = Path(pair[0]).parent / "prompts.json"
    path.write_text(json.dumps([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]))
    return path


def test_a_schedule_with_forwards_queued_ahead_is_lossless(pair):
    """The graph runners' padded path on CPU queues the next step's forward ahead when the
    policy expects a target-only step (``BatchSizeK.expects_target_only``: K = 0 at this batch
    size). As requests finish the batch crosses the schedule's ranges (0 above 2 requests, K at
    1-2), so a forward queued at one size may meet a step that drafts: the output must still be
    target-only's, and some queued forwards must be taken."""
    schedule = [[1, 2, K], [3, 8, 0]]
    llm = _spec(pair, schedule)
    engine = llm.engine
    engine.attach_graph_runners()
    taken, decode = [], engine._decode
    engine._decode = lambda seqs, ahead=None: (
        taken.append(ahead is not None and ahead.rows_for(seqs) is not None), decode(seqs, ahead))[1]
    prompts, params = _shrinking_batch(5, 8, 6)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == _target_only(pair, prompts, params)
    assert any(taken) and sum(o.metrics["num_drafts"] for o in got) > 0
