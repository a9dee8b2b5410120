"""vLLM's priority scheduling (``--scheduling-policy priority``, a request's ``priority``: lower
first, then arrival; engine/scheduler.py): the queues' order, admission, preemption of the
least urgent running request, the engine and LLM entry points and their errors, the server's
field, and outputs unchanged by the order requests ran in (greedy and seeded, with DFlash).
"""

from __future__ import annotations

import pytest

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine.kv_cache import BlockAllocator
from laguna_dflash.engine.scheduler import Scheduler
from laguna_dflash.engine.sequence import Sequence, Status

PROMPTS = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2], [7, 7], [1, 2, 3]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("priority"), 4)


def test_waiting_queue_orders_by_priority_then_arrival():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=1, max_num_batched_tokens=64,
                      scheduling_policy="priority")
    p = SamplingParams(max_tokens=4)
    seqs = [Sequence(i, [1, 2], p, priority=prio) for i, prio in enumerate([3, -1, 3, 0, -1])]
    for s in seqs:
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == [1, 4, 3, 0, 2]
    batch = sched.schedule()  # one slot: the most urgent, earliest
    assert batch.is_prefill and batch.sequences == [seqs[1]]


def test_first_come_first_served_ignores_priority_order():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=4)
    for i, prio in enumerate([3, -1, 0]):
        sched.add(Sequence(i, [1, 2], p, priority=prio))
    assert [s.request_id for s in sched.waiting] == [0, 1, 2]


def test_the_least_urgent_running_request_is_preempted():
    """Blocks run out in a decode step: the victim is the running request with the largest
    (priority, arrival), whatever the admission order; it waits in its place by priority."""
    alloc = BlockAllocator(6, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="priority")
    p = SamplingParams(max_tokens=100)
    urgent, lazy, middle = (Sequence(i, [1] * 6, p, priority=prio) for i, prio in enumerate([0, 5, 1]))
    for s in (lazy, urgent, middle):
        sched.add(s)
    batch = sched.schedule()
    assert batch.is_prefill and batch.sequences == [urgent, middle, lazy]  # 2 blocks each
    for s in batch.sequences:
        s.num_computed = 6
        s.output_token_ids += [1, 1, 1]  # decode needs a third block each: 9 > 6 blocks
    batch = sched.schedule()
    assert not batch.is_prefill and batch.sequences == [urgent, middle]
    assert lazy.status == Status.WAITING and lazy.num_preemptions == 1
    assert urgent.num_preemptions == middle.num_preemptions == 0
    later = Sequence(9, [1, 2], p, priority=0)
    sched.add(later)
    assert list(sched.waiting) == [later, lazy]  # priority 0 goes before the preempted 5


def finish_order(llm: LLM, params: SamplingParams, priorities: list[int]) -> tuple[list[int], dict]:
    """Add every prompt, then step: -> the prompts' indices in the order they finished, and
    each prompt's output tokens."""
    seqs = [llm.engine.add_request(ids, params, priority=prio) for ids, prio in zip(PROMPTS, priorities)]
    index = {s.request_id: i for i, s in enumerate(seqs)}
    order = []
    while llm.engine.has_unfinished:
        order += [index[s.request_id] for s in llm.engine.step()]
    return order, {index[s.request_id]: s.output_token_ids for s in seqs}


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_runs_the_most_urgent_first_and_outputs_do_not_change(pair, speculative):
    target, draft = pair
    kw = dict(draft=str(draft), num_speculative_tokens=3) if speculative else {}
    llm = LLM(str(target), max_num_seqs=1, scheduling_policy="priority", **kw)
    fcfs = LLM(str(target), max_num_seqs=1, **kw)
    priorities = [4, -2, 7, 0, -2]
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)):
        order, outputs = finish_order(llm, params, priorities)
        assert order == [1, 4, 3, 0, 2]
        base_order, base = finish_order(fcfs, params, [0] * len(PROMPTS))
        assert base_order == [0, 1, 2, 3, 4] and outputs == base


def test_llm_generate_takes_vllm_priority_list(pair):
    llm = LLM(str(pair[0]), scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, priority=[2, 0, 1])
    base = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params)
    assert [o.token_ids for o in out] == [o.token_ids for o in base]  # outputs in prompt order
    with pytest.raises(ValueError, match=r"priority must be a list of one integer a prompt \(3\)"):
        llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, priority=[1])


def test_errors(pair):
    fcfs = LLM(str(pair[0]))
    with pytest.raises(ValueError, match="priority=2 needs the priority scheduling policy"):
        fcfs.generate(prompt_token_ids=PROMPTS[:2], sampling_params=SamplingParams(max_tokens=2),
                      priority=[0, 2])
    assert not fcfs.engine.has_unfinished  # the first prompt's request was aborted with it
    with pytest.raises(ValueError, match="priority must be an integer"):
        fcfs.engine.add_request([1, 2], SamplingParams(), priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        LLM(str(pair[0]), scheduling_policy="lifo")


def test_server_priority_field(pair):
    import dflash_fixtures as df

    body = {"prompt": [3, 1, 4], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with df.tiny_http_server(pair[0], "--max-model-len", "64", "--scheduling-policy", "priority") as http:
        urgent = http.post("/v1/completions", json={**body, "priority": -5})
        assert urgent.status_code == 200, urgent.text
        chat_ids = http.post("/v1/completions", json={**body, "priority": 9}).json()
        assert chat_ids["choices"][0]["text"] == urgent.json()["choices"][0]["text"]
        r = http.post("/v1/completions", json={**body, "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
