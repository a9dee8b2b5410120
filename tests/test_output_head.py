"""The greedy output head (engine/output_head.py): greedy steps take their tokens from inside the
forward (on CUDA, inside its graph replay) and give the tokens of the eager lm_head + sampler.

CPU tests run the engine eagerly and through the graph runner's padded path (what the graphs
replay); the CUDA tests of tests/test_cuda_graphs.py replay the captured graphs with the head on.
"""

from __future__ import annotations

import random

import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine import output_head
from laguna_dflash.engine.output_head import GreedyHead
from laguna_dflash.kernels.argmax import argmax_rows

BLOCK_SIZE = 6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("head")
    target = df.make_tiny_laguna_target(root / "laguna", seed=3)
    draft = df.make_poolside_laguna_drafter(root / "poolside", target, seed=3, block_size=BLOCK_SIZE)
    return target, draft


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 60) for _ in range(3 + 7 * i)] for i in range(n)]


class _Model(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden))

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)


@pytest.mark.parametrize("first_row", [0, 1])
def test_greedy_head_is_the_argmax_of_the_lm_head_rows(first_row):
    torch.manual_seed(0)
    model = _Model(50, 8)
    hidden = torch.randn(3, 4, 8)
    got = GreedyHead(model, first_row)(hidden)
    rows = hidden[:, first_row:].reshape(-1, 8)
    want = torch.argmax(rows @ model.weight.T, dim=-1).view(3, 4 - first_row)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    assert torch.equal(got, argmax_rows(model.lm_head_logits(rows)).view_as(got))
    # one object per model and row offset: the CUDA graphs are keyed by it
    assert GreedyHead(model, first_row) == GreedyHead(model, first_row)
    assert hash(GreedyHead(model, first_row)) == hash(GreedyHead(model, first_row))
    assert GreedyHead(model, 0) != GreedyHead(model, 1)


def _run(target, draft, monkeypatch, in_graph: bool, graphs: bool, params_of, k: int, **llm_kw):
    """Generate batches of 1, 3 and 5 -> ([(tokens, drafts, logprobs)], per batch the head of
    every decode-phase forward)."""
    monkeypatch.setattr(output_head, "in_graph", in_graph)
    kw = dict(draft=draft, num_speculative_tokens=k, trace=True) if k else {}
    llm = LLM(target, block_size=4, max_num_seqs=6, **kw, **llm_kw)
    engine = llm.engine
    if graphs:
        engine.attach_graph_runners()  # CPU: the padded path the graphs replay, run eagerly
    heads = []
    runners = [engine.runner] + ([engine.proposer.runner] if k else [])
    for runner in runners:
        forward = runner.forward

        def spy(input_ids, items, *args, forward=forward, **kwargs):
            if all(it.start_pos > 0 for it in items):  # decode-phase forwards, not prefills
                heads.append(kwargs.get("head"))
            return forward(input_ids, items, *args, **kwargs)

        runner.forward = spy
    out, heads_by_batch = [], []
    for batch_size in (1, 3, 5):
        params = [params_of(i) for i in range(batch_size)]
        heads.clear()
        for o in llm.generate(prompt_token_ids=_prompts(batch_size, 10 + batch_size), sampling_params=params):
            drafts = [st["draft_tokens"] for st in o.metrics["trace"]] if k else []
            out.append((o.token_ids, drafts, o.logprobs))
        heads_by_batch.append(list(heads))
    return out, heads_by_batch


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_greedy_steps_take_their_tokens_from_the_head(pair, monkeypatch, graphs, k):
    """All-greedy batches: the same tokens (and drafts) with the head inside the forward as with
    the eager lm_head + sampler, and the forwards of decode steps really get the head (the
    drafter's too: its row offset 1)."""
    target, draft = pair

    def greedy(i):
        return SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True)

    want, heads_off = _run(target, draft, monkeypatch, False, graphs, greedy, k)
    got, heads_on = _run(target, draft, monkeypatch, True, graphs, greedy, k)
    assert got == want
    assert not any(h for heads in heads_off for h in heads)
    first_rows = {h.first_row for heads in heads_on for h in heads if h is not None}
    assert first_rows == ({0, 1} if k else {0}), first_rows
    if k:
        assert any(drafts for _, drafts, _ in got)  # speculative steps really drafted


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_and_logprob_batches_keep_the_hidden_states(pair, monkeypatch, k):
    """A batch with a seeded sampled request or one that wants logprobs keeps the eager sampler
    (no target head for its steps); the requests ending at different steps leave all-greedy
    batches behind, which take the head again (a forward queued ahead without the head is still
    taken). Tokens, drafts and logprobs equal the engine without the head."""
    target, draft = pair

    def mixed(i):
        if i == 1:
            return SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=4, ignore_eos=True)
        if i == 2:  # outlives the sampled request: greedy batches with logprobs follow
            return SamplingParams(temperature=0, logprobs=2, max_tokens=9, ignore_eos=True)
        return SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True)

    want, _ = _run(target, draft, monkeypatch, False, True, mixed, k)
    got, heads_by_batch = _run(target, draft, monkeypatch, True, True, mixed, k)
    assert got == want
    assert any(lp for _, _, lp in got)  # logprobs were produced
    # batch 5: the sampled and the logprob request first (no target head), the greedy ones last
    target_heads = [h for h in heads_by_batch[-1] if h is None or h.first_row == 0]
    assert target_heads[0] is None and target_heads[-1] is not None, target_heads


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [0, 3])
def test_head_inside_the_replayed_graphs_gives_the_eager_heads_tokens_on_cuda(pair, monkeypatch, dtype, k):
    """On the GPU the head is captured into the decode, verify and drafter-block graphs: the
    tokens and drafts equal those of the same graphs without it (lm_head and argmax after the
    replay), at batch 1, 3 and 5 (padded to the capture sizes 1, 4 and 6)."""
    target, draft = pair

    def greedy(i):
        return SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True)

    kw = dict(device="cuda", dtype=dtype)
    want, _ = _run(target, draft, monkeypatch, False, False, greedy, k, **kw)
    got, heads_by_batch = _run(target, draft, monkeypatch, True, False, greedy, k, **kw)
    assert got == want
    assert all(h is not None for heads in heads_by_batch for h in heads)
