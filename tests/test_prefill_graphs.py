"""Prefill steps replayed from CUDA graphs (``CUDAGraphRunner.prefill_shape``): up to four
requests, each padded to the longest one's token bucket, give the eager prefill's output and
write K/V only where a padded forward may (the request's own unused slots, the scratch block).

CPU tests drive the runner's eager padded path (the same buffers and on-device metadata as the
replay); the CUDA test captures real graphs and compares with eager prefills in float32.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import EngineConfig
from laguna_dflash.engine.cuda_graph import MAX_PREFILL_GRAPH_REQUESTS, CUDAGraphRunner
from laguna_dflash.engine.kv_cache import KVCache
from laguna_dflash.engine.runner import ForwardItem

BLOCK_SIZE = 6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("prefill_graphs"), BLOCK_SIZE)


def _runner(max_prefill_tokens: int, max_num_seqs: int = 8, max_model_len: int = 1000) -> CUDAGraphRunner:
    kv = KVCache(1, 400, 4, 1, 8, torch.float32, "cpu")
    return CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, max_tokens_per_request=4,
                           max_prefill_tokens=max_prefill_tokens)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 60) for _ in range(n)] for n in lengths]


def _graphed(llm: LLM) -> list[tuple[int, int]]:
    """Attach the graph runners (eager padded path on the CPU) and record the ``(R_pad, q_pad)``
    of every prefill forward they run."""
    llm.engine.attach_graph_runners()
    graphs = llm.engine.runner.graphs
    shapes: list[tuple[int, int]] = []
    forward = graphs.forward

    def spy(*args, shape=None, **kw):
        if shape is not None:
            shapes.append(shape)
        return forward(*args, shape=shape, **kw)

    graphs.forward = spy
    return shapes


def test_prefill_shape_buckets_and_limits():
    runner = _runner(512)
    assert runner.prefill_buckets == (8, 16, 32, 64, 128, 256, 512)
    assert runner.prefill_batch_sizes == (1, 2, 4)
    one = lambda n, start=0: ForwardItem(n, start, start + n, [0])  # noqa: E731
    assert runner.prefill_shape([one(5)], 5) == (1, 8)
    assert runner.prefill_shape([one(9, start=32)], 9) == (1, 16)
    assert runner.prefill_shape([one(512)], 512) == (1, 512)
    assert runner.prefill_shape([one(513)], 513) is None  # past the largest bucket
    assert runner.prefill_shape([one(3), one(40)], 43) == (2, 64)  # padded to the longest
    assert runner.prefill_shape([one(3)] * 3, 9) == (4, 8)  # a padding request
    assert runner.prefill_shape([one(200), one(3)], 203) == (2, 256)
    assert runner.prefill_shape([one(300), one(3)], 303) is None  # 2 x 512 > 512
    assert runner.prefill_shape([one(1)] * (MAX_PREFILL_GRAPH_REQUESTS + 1), 5) is None
    assert runner.prefill_shape([ForwardItem(4, 0, 9, [0])], 4) is None  # a chunk not ending its sequence
    assert runner.prefill_shape([one(5)], 6) is None  # token count mismatch
    near_end = runner.max_keys - 8
    assert runner.prefill_shape([one(5, start=near_end)], 5) == (1, 8)
    assert runner.prefill_shape([one(5, start=near_end + 1)], 5) is None  # padding past the table
    assert _runner(0).prefill_shape([one(5)], 5) is None  # off
    assert _runner(100).prefill_buckets == (8, 16, 32, 64)


def test_capture_all_covers_the_prefill_buckets(monkeypatch):
    """Start-up capture (add_prefill_kinds) enumerates every prefill bucket x the request counts
    whose padded tokens fit x the key buckets up to max_model_len + q - 1 keys (here 1024 for
    every bucket), none smaller than the bucket."""
    runner = _runner(256, max_num_seqs=8, max_model_len=600)
    runner.add_prefill_kinds((1, 3))
    captured = []
    monkeypatch.setattr(runner, "_capture", lambda *a, build_first=True: captured.append(a[:4]) or "graph")
    monkeypatch.setattr(runner, "device", types.SimpleNamespace(type="cuda"))
    sizes = {8: (1, 2, 4), 16: (1, 2, 4), 32: (1, 2, 4), 64: (1, 2, 4), 128: (1, 2), 256: (1,)}
    want = {(r, q, n, True) for q, rs in sizes.items() for r in rs for n in (256, 512, 1024)}
    assert runner.capture_all(600) == len(want) == 45
    assert set(captured) == want
    assert runner.kind_batch_sizes((4, True, (), True)) == runner.batch_sizes  # decode kinds: all
    # a prefill bucket that a decode-phase forward also runs (K + 1 = 16) is captured at every
    # batch size; a prefill-only one at those prefill_shape can pick
    runner._add_kind((16, True, (1, 3), False), None, is_prefill=False)
    assert runner.kind_batch_sizes((16, True, (1, 3), False)) == runner.batch_sizes
    assert runner.kind_batch_sizes((32, True, (1, 3), False)) == (1, 2, 4)
    small = _runner(512, max_model_len=200)  # 256 keys at most: no prompt pads to 512
    small.add_prefill_kinds(())
    assert {k[1] for k, _ in small.missing_keys(200)} == {8, 16, 32, 64, 128, 256}


def test_max_prefill_graph_tokens_is_checked_and_parsed():
    with pytest.raises(ValueError, match="--max-prefill-graph-tokens"):
        EngineConfig(model="x", max_prefill_graph_tokens=-1)
    from laguna_dflash.cli import build_parser, engine_options

    args = build_parser().parse_args(["generate", "--model", "m", "--max-prefill-graph-tokens", "64"])
    assert engine_options(args)["max_prefill_graph_tokens"] == 64


@pytest.mark.parametrize("use_draft", [False, True])
def test_padded_prefills_match_eager_on_cpu(pair, use_draft):
    """Greedy tokens (and prompt logprobs) with every prefill through the padded path equal the
    eager engine's: single prompts of several buckets, a mixed batch (rows gathered), a batch
    too long for a graph (eager), and with DFlash (the taps come back through the padding)."""
    target, draft = pair
    kw = dict(block_size=4, max_num_seqs=6, max_prefill_graph_tokens=128)
    if use_draft:
        kw.update(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1)
    plain, padded = LLM(target, **kw), LLM(target, **kw)
    shapes = _graphed(padded)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    for lengths in ([7], [17], [40], [3, 29, 11], [50, 45], [50, 45, 40], [7, 7]):
        prompts = _prompts(lengths, seed=sum(lengths))
        want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
        got = padded.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], lengths
        for g, w in zip(got, want):
            for gp, wp in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                assert gp.keys() == wp.keys()
                for t in gp:
                    assert abs(gp[t] - wp[t]) < 1e-4
    assert {(1, 8), (1, 32), (1, 64), (4, 32), (2, 64), (2, 8)} <= set(shapes), shapes
    assert (4, 64) not in shapes  # [50, 45, 40] pads to 4 x 64 > 128: eager


def test_padded_prefills_with_prefix_cache_and_chunks_match_eager_on_cpu(pair):
    """A prefix-cache hit's suffix and chunked prefill's last chunk (the others do not end
    their sequence: eager) through the padded path, with a request decoding between the
    chunks, give the eager engine's tokens and every DFlash draft."""
    target, draft = pair
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=24, draft=draft,
              num_speculative_tokens=BLOCK_SIZE - 1, trace=True)
    plain, padded = LLM(target, **kw), LLM(target, **kw)
    shapes = _graphed(padded)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prefix = _prompts([30], seed=1)[0]
    runs = []
    for llm in (plain, padded):
        first = llm.generate(prompt_token_ids=[prefix + [1, 2, 3]], sampling_params=params)
        engine = llm.engine
        a = engine.add_request(prefix + [4, 5, 6, 7, 8], params)  # prefix cached: a short suffix
        engine.step()
        b = engine.add_request(_prompts([70], seed=2)[0], params)  # chunks of 24, a decode between
        while engine.has_unfinished:
            engine.step()
        runs.append((first[0].token_ids, a.output_token_ids, b.output_token_ids, a.num_cached_tokens,
                     [t["draft_tokens"] for s in (a, b) for t in s.trace]))
    assert runs[0] == runs[1]
    assert runs[1][3] >= 28  # the prefix was a cache hit
    assert shapes, "no prefill went through the padded path"


def test_padded_prefill_writes_only_its_own_and_scratch_slots(pair):
    """A padded prefill next to a running request changes no K/V slot but the new request's
    blocks and the scratch block: the running request's and the free blocks stay bitwise."""
    target, _ = pair
    llm = LLM(target, block_size=4, max_num_seqs=4, max_prefill_graph_tokens=64)
    shapes = _graphed(llm)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    running = engine.add_request(_prompts([9], seed=3)[0], params)
    for _ in range(3):
        engine.step()
    caches = engine.runner.kv_cache.layers
    before = [tuple(t.clone() for t in layer) for layer in caches]
    free_before = set(engine.allocator._free)
    taken: list[int] = []  # blocks handed out in the step (a hybrid layout frees some after it)
    allocate = engine.allocator.allocate
    engine.allocator.allocate = lambda n: (blocks := allocate(n), taken.extend(blocks))[0]
    # 9 tokens pad to 16: padding positions 9..15 run past its blocks (scratch block there)
    new = engine.add_request(_prompts([9], seed=4)[0], params)
    shapes.clear()
    engine.step()
    assert shapes == [(1, 16)] and new.num_computed == 9
    assert len(new.block_table) * engine.runner.kv_cache.block_size < 16
    bs = engine.runner.kv_cache.block_size

    def held(seq):  # every block the request holds: its table's and, hybrid, its SWA groups'
        return seq.block_table + [b for t in seq.swa_block_tables for b in t[seq.swa_start:]]

    # the running request's blocks, and those free before the step that it did not hand out
    kept = set(held(running)) | (free_before - set(taken))
    assert kept and set(held(new)) <= set(taken)
    kept_slots = {b * bs + i for b in kept for i in range(bs)}
    for layer, old in zip(caches, before):
        for new_t, old_t in zip(layer, old):
            changed = {int(i) for i in (new_t != old_t).flatten(1).any(1).nonzero().flatten()}
            assert changed and not changed & kept_slots


@pytest.mark.full_warmup
def test_warmup_shapes_build_the_eager_prefill(pair):
    """The warm-up's listed prompt shapes build the kernels of the EAGER prefill (longer prompts
    and larger batches still run it), so no prefill graph takes them even where one could; the
    two decoding requests before them do take the graphs, and the buckets are back afterwards."""
    target, _ = pair
    llm = LLM(target, dtype="bfloat16", block_size=4, max_num_seqs=2, max_model_len=400)
    shapes = _graphed(llm)
    buckets = llm.engine.runner.graphs.prefill_buckets
    llm.engine.warmup()
    assert shapes == [(1, 8), (1, 16)]  # the 8- and 16-token decoding requests only
    # the default 2048 tokens, capped by the key capacity (max_model_len 400: 512 keys)
    assert llm.engine.runner.graphs.prefill_buckets == buckets == (8, 16, 32, 64, 128, 256, 512)


@needs_cuda
def test_prefill_graphs_match_eager_on_cuda(pair):
    """Captured prefill graphs (replayed, several buckets, a mixed batch) give the eager
    engine's greedy tokens in float32, with DFlash."""
    target, draft = pair
    kw = dict(device="cuda", block_size=4, max_num_seqs=6, draft=draft,
              num_speculative_tokens=BLOCK_SIZE - 1, cuda_graph_capture="lazy")
    graphed = LLM(target, max_prefill_graph_tokens=128, **kw)
    eager = LLM(target, max_prefill_graph_tokens=0, **kw)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for lengths in ([7], [17], [60], [3, 29, 11]):
        prompts = _prompts(lengths, seed=sum(lengths))  # no shared prefix: no cache hit
        want = [o.token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=params)]
        got = [o.token_ids for o in graphed.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, lengths
    prefill_keys = {k[:2] for k in graphed.engine.runner.graphs.graphs if k[1] > BLOCK_SIZE}
    assert {(1, 8), (1, 32), (1, 64), (4, 32)} <= prefill_keys, prefill_keys
    assert not any(k[1] > BLOCK_SIZE for k in eager.engine.runner.graphs.graphs)


def test_graphed_forwards_stay_below_max_positions():
    # max_positions (what the RoPE tables cover): max_model_len + the largest of a prefill
    # bucket and 2 (K + 1) (a drafter block queued ahead), at most the key capacity; a forward
    # that would compute a position at or past it is refused (it runs eagerly)
    runner = _runner(64, max_model_len=300)  # K + 1 = 4, buckets up to 64, 512 keys
    assert runner.max_positions == 300 + 64
    assert _runner(0, max_model_len=300).max_positions == 300 + 2 * 4
    assert _runner(512, max_model_len=300).max_positions == 512  # the key capacity
    table = list(range(100))
    assert runner.can_run([ForwardItem(4, 360, 364, table)], 4)
    assert not runner.can_run([ForwardItem(4, 361, 365, table)], 4)
    assert runner.prefill_shape([ForwardItem(40, 300, 340, table)], 40) == (1, 64)  # ends at 364
    assert runner.prefill_shape([ForwardItem(40, 301, 341, table)], 40) is None


@pytest.mark.parametrize("use_draft", [False, True])
def test_padded_prefill_past_max_model_len_matches_eager_on_cpu(pair, use_draft):
    """A prefill bucket may run past ``max_model_len`` (its padding positions go up to the key
    capacity): the RoPE tables must cover every position a padded forward computes, or a
    graphed prefill reads past them (found on the H200: an illegal memory access capturing the
    2048-token bucket at max_model_len 1280). Here a 280-token prompt pads to 512 positions at
    max_model_len 300 (the tables' own minimum is 256); the CPU's indexing raises where CUDA
    reads out of bounds."""
    target, draft = pair
    kw = dict(block_size=4, max_num_seqs=2, max_model_len=300, max_prefill_graph_tokens=512)
    if use_draft:
        kw.update(draft=draft, num_speculative_tokens=3)
    plain, padded = LLM(target, **kw), LLM(target, **kw)
    shapes = _graphed(padded)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = _prompts([280], seed=5)
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = padded.generate(prompt_token_ids=prompts, sampling_params=params)
    assert (1, 512) in shapes, shapes
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    graphs = padded.engine.runner.graphs
    assert graphs.max_positions >= 512  # the padding's last position is 511
    assert all(r.cos.shape[0] >= graphs.max_positions for r in padded.engine.target.rotaries)


def test_drafts_up_to_max_model_len_stay_inside_the_rope_tables_on_cpu(pair):
    """A DFlash request that runs to ``max_model_len``, its drafter blocks queued ahead (they
    reach ``P + 2K + 1``): its tokens equal the target-only engine's, and every position either
    graph runner computed (real and padding) lies inside that model's RoPE tables, which cover
    the runner's bound."""
    target, draft = pair
    kw = dict(block_size=4, max_num_seqs=2, max_model_len=300)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts([270], seed=6)
    want = LLM(target, **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    spec = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, **kw)
    spec.engine.attach_graph_runners()
    runners = ((spec.engine.runner, spec.engine.target), (spec.engine.proposer.runner, spec.engine.drafter))
    ends = {id(runner): [] for runner, _ in runners}
    for runner, _ in runners:
        graphs, seen = runner.graphs, ends[id(runner)]
        run_model = graphs._run_model

        def spy(r, q, *args, graphs=graphs, run_model=run_model, seen=seen):
            seen.append(int(graphs.start_pos[:r].max()) + q)  # one past the last position
            return run_model(r, q, *args)

        graphs._run_model = spy
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert len(want[0].token_ids) == 30  # stopped by max_model_len
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for runner, model in runners:
        assert ends[id(runner)], "no forward through the graph runner"
        table = min(r.cos.shape[0] for r in model.rotaries)
        assert max(ends[id(runner)]) <= runner.graphs.max_positions <= table
