"""CUDA-graph runner: padded, fixed-shape decode-phase forwards give the eager engine's output.

CPU tests drive ``CUDAGraphRunner`` through its eager padded path (same buffers, same on-device
metadata, no capture), so the padding rules (batch buckets, key buckets, scratch-block padding
requests) are checked everywhere. CUDA tests capture and replay real graphs and compare with
``enforce_eager=True`` on the same weights, for target-only decoding and DFlash speculation.
"""

from __future__ import annotations

import contextlib
import logging
import random

import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import EngineConfig
from laguna_dflash.engine.cuda_graph import CUDAGraphRunner, capture_batch_sizes
from laguna_dflash.engine.runner import ForwardItem, build_metadata

BLOCK_SIZE = 6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("graphs")
    target = df.make_tiny_laguna_target(root / "laguna", seed=0)
    draft = df.make_poolside_laguna_drafter(root / "poolside", target, seed=0, block_size=BLOCK_SIZE)
    return target, draft


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 9, 17, 26, 5, 33, 12][:n]
    return [[rng.randrange(0, 60) for _ in range(length)] for length in lengths]


class _WarningList(logging.Handler):
    """Collects the WARNING (and worse) messages it handles (tests run with ``-p no:logging`` on
    the GPU, so without ``caplog``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _assert_same_greedy_tokens(reference: LLM, other: LLM, batch_sizes: tuple[int, ...], seed: int,
                               length: int, step: int) -> None:
    """``other`` generates ``reference``'s greedy tokens (40 each) for batches of prompts of
    ``length + step * i`` tokens (past the first key bucket)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rng = random.Random(seed)
    for batch_size in batch_sizes:
        prompts = [[rng.randrange(0, 60) for _ in range(length + step * i)] for i in range(batch_size)]
        want = [o.token_ids for o in reference.generate(prompt_token_ids=prompts, sampling_params=params)]
        got = [o.token_ids for o in other.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, f"batch {batch_size}"


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == (1,)
    assert capture_batch_sizes(5) == (1, 2, 4, 5)
    assert capture_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_batch_sizes(20) == (1, 2, 4, 8, 16, 20)


def test_padded_metadata_matches_build_metadata():
    """Real rows of the on-device padded metadata equal the runner's per-forward metadata."""
    from laguna_dflash.engine.kv_cache import KVCache

    kv = KVCache(1, 40, 4, 1, 8, torch.float32, "cpu")
    runner = CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=8,
                             max_model_len=100, max_tokens_per_request=3)
    items = [ForwardItem(3, 10, 13, [5, 2, 9, 7]), ForwardItem(3, 0, 3, [1]), ForwardItem(3, 4, 7, [3, 4])]
    ref = build_metadata(items, 4, kv.scratch_slot, torch.device("cpu"))
    runner.start_pos[:4] = torch.tensor([10, 0, 4, 0])
    runner.seq_lens[:4] = torch.tensor([13, 3, 7, 3])
    runner.block_tables[:4] = runner.scratch_block
    for i, it in enumerate(items):
        runner.block_tables[i, : len(it.block_table)] = torch.tensor(it.block_table)
    meta, = runner._metadata(4, 3, runner.key_bucket(13), is_causal=True)  # one table: no hybrid layout
    assert meta.key_slots.shape == (4, 256)
    assert torch.equal(meta.positions[:9], ref.positions)
    assert torch.equal(meta.slot_mapping[:9], ref.slot_mapping)
    assert torch.equal(meta.key_slots[:3, : ref.key_slots.shape[1]], ref.key_slots)
    assert (meta.key_slots[:3, ref.key_slots.shape[1]:] == kv.scratch_slot).all()
    # the padding request writes and reads only inside the scratch block
    scratch = range(kv.scratch_slot, kv.scratch_slot + 4)
    assert all(int(s) in scratch for s in meta.slot_mapping[9:])


class _StreamLog:
    """Fake ``torch.cuda`` streams and events that log what the graph runner orders (a CPU check
    of its CUDA-only upload paths: the copies themselves run on the CPU)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.main = self.Stream("main", self)
        self.current = self.main
        self.num_events = 0

    class Stream:
        def __init__(self, name: str, owner: _StreamLog) -> None:
            self.name, self.owner = name, owner

        def wait_event(self, event) -> None:
            self.owner.log.append((self.name, "waits for", event.name))

        def wait_stream(self, other) -> None:
            self.owner.log.append((self.name, "waits for stream", other.name))

    class Event:
        def __init__(self, name: str, owner: _StreamLog) -> None:
            self.name, self.owner = name, owner

        def record(self, stream=None) -> None:
            self.owner.log.append(((stream or self.owner.current).name, "records", self.name))

        def synchronize(self) -> None:  # the host's wait (the copies ran already, on the CPU)
            pass

    def install(self, monkeypatch) -> None:
        def new_event():
            self.num_events += 1
            return self.Event(f"event{self.num_events}", self)

        @contextlib.contextmanager
        def on(stream):
            before, self.current = self.current, stream
            try:
                yield
            finally:
                self.current = before

        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: self.Stream("side", self))
        monkeypatch.setattr(torch.cuda, "Event", new_event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", on)


def test_uploads_are_ordered_before_the_next_write_and_replay(monkeypatch):
    """A forward's rows go up on the current stream, behind any staged side-stream upload, before
    the rows are written (a drafter block's rewind) and replayed. ``stage_decode`` uploads on a
    side stream that waits for the whole current stream (its lm_head has not run yet, the last
    replay read the rows), and records the event ``run_staged``'s replay waits for."""
    import types

    from laguna_dflash.engine import cuda_graph
    from laguna_dflash.engine.cuda_graph import DeviceStart, _Captured
    from laguna_dflash.engine.kv_cache import KVCache

    kv = KVCache(1, 40, 4, 1, 8, torch.float32, "cpu")
    runner = CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=2,
                             max_model_len=100, max_tokens_per_request=3)
    streams = _StreamLog()
    streams.install(monkeypatch)
    runner.copied = streams.Event("copied", streams)
    monkeypatch.setattr(runner, "device", types.SimpleNamespace(type="cuda"))
    monkeypatch.setattr(cuda_graph, "rewind_rows", lambda *args: streams.log.append((streams.current.name, "rewinds")))

    class Graph:
        def replay(self) -> None:
            streams.log.append((streams.current.name, "replays"))

    q, num_keys = 3, runner.key_bucket(13)
    runner.graphs[(1, q, num_keys, True, (), False)] = _Captured(Graph(), torch.zeros(3, 4), None)
    items = [ForwardItem(q, 10, 13, [5, 2, 9, 7])]
    start = DeviceStart(torch.zeros(1, dtype=torch.long), torch.zeros(1, q + 1, dtype=torch.long))
    hidden, _ = runner.forward([1, 2, 3], items, (), True, device_start=start)
    assert hidden.shape == (3, 4)
    assert runner.state[0, 0] == 10 and runner.state[0, 1] == 13  # the rows went up
    assert streams.log == [("main", "records", "copied"), ("main", "rewinds"), ("main", "replays")]
    streams.log.clear()
    staged = runner.stage_decode([ForwardItem(1, 13, 14, [5, 2, 9, 7])], ())
    assert streams.log == [("side", "waits for stream", "main"), ("side", "records", "copied"),
                           ("side", "records", "event1")]
    assert runner._staged_upload is not None  # run_staged's replay waits for it
    assert staged.ids.shape == (1,)
    streams.log.clear()
    runner.forward([4, 5, 6], items, (), True, device_start=start)  # waits for the staged upload first
    assert streams.log[:2] == [("main", "waits for", "event1"), ("main", "records", "copied")]
    assert runner._staged_upload is None


def test_key_buckets_cover_every_length_up_to_the_limit():
    from laguna_dflash.engine.kv_cache import KVCache

    kv = KVCache(1, 40, 6, 1, 8, torch.float32, "cpu")
    runner = CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=8,
                             max_model_len=2000, max_tokens_per_request=4)
    assert runner.key_buckets(1) == [258]  # 256 rounded up to the block size
    buckets = runner.key_buckets(2003)
    assert buckets == [258, 516, 1026, 2052]  # powers of two rounded up to the block size
    for n in (1, 257, 258, 259, 1500, 2003):  # every length's bucket is captured
        assert runner.key_bucket(n) in buckets
    assert runner.key_buckets(10**6)[-1] == runner.max_keys  # never past the runner's limit
    assert runner.capture_all(2000) == 0  # on the CPU nothing is captured


def test_capture_all_covers_every_size_and_bucket_of_each_kind(monkeypatch):
    """capture_all's enumeration, on the CPU with the capture itself recorded instead of run:
    every padded batch size x key bucket (up to max_model_len + q - 1 keys) of each forward kind
    seen, each with its kind's context store, under inference mode (a capture outside it takes
    the eager fallbacks), on padding rows only; a second call captures nothing."""
    import types

    from laguna_dflash.engine.kv_cache import KVCache

    kv = KVCache(1, 40, 16, 1, 8, torch.float32, "cpu")
    runner = CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=5,
                             max_model_len=1024, max_tokens_per_request=4)
    store = object()
    runner.kinds = {(4, True, (1, 3), True): store, (1, True, (1, 3), False): None}
    captured = []

    def fake_capture(r, q, num_keys, is_causal, taps, context_store, build_first=True):
        assert not build_first  # start-up's pass built the kernels already
        captured.append((r, q, num_keys, is_causal, taps, context_store))
        assert torch.is_inference_mode_enabled()
        state = runner.state[:r]
        assert (state[:, 1] == q).all() and (state[:, 0] == 0).all()  # padding requests
        assert (state[:, 2 : runner.ids_offset] == runner.scratch_block).all()
        return "graph"

    monkeypatch.setattr(runner, "_capture", fake_capture)
    monkeypatch.setattr(runner, "device", types.SimpleNamespace(type="cuda"))
    runner.host_rows[:, 1] = 4  # a real forward's rows left behind: rewritten, not trusted
    runner.host_rows[:, 2:] = 7
    assert len(runner.missing_keys(1024)) == 28
    sizes = runner.batch_sizes
    assert sizes == (1, 2, 4, 5)
    # a 4-token verify may reach 1027 keys: the 2048 bucket too; a 1-token forward 1024
    want = {(r, 4, n, True, (1, 3), store) for r in sizes for n in (256, 512, 1024, 2048)}
    want |= {(r, 1, n, True, (1, 3), None) for r in sizes for n in (256, 512, 1024)}
    ran = []  # the forwards the kernels are built ahead from: the same keys
    monkeypatch.setattr(runner, "_run_model", lambda *args: ran.append(args))
    for forward in runner.forwards_to_capture(1024):
        forward()
    assert len(ran) == 28 and set(ran) == want
    bar = types.SimpleNamespace(n=0)
    bar.update = lambda k: setattr(bar, "n", bar.n + k)
    assert runner.capture_all(1024, bar) == len(captured) == bar.n == 28
    assert set(captured) == want
    assert runner.capture_all(1024) == 0 and runner.missing_keys(1024) == []


def test_context_capture_all_covers_every_size(monkeypatch):
    import types

    from laguna_dflash.engine.context_graph import ContextGraphRunner
    from laguna_dflash.engine.kv_cache import KVCache

    kv = KVCache(1, 40, 16, 1, 8, torch.float32, "cpu")
    runner = ContextGraphRunner(torch.nn.Identity(), kv, torch.device("cpu"), max_num_seqs=9,
                                rows_per_request=4, feature_dim=8, dtype=torch.float32)
    seen = []

    def fake_capture(r, build_first=True):
        assert not build_first  # start-up's pass built the kernels already
        assert torch.is_inference_mode_enabled()
        assert (runner.index[0] == 0).all() and (runner.index[1] == kv.scratch_slot).all()
        seen.append(r)
        runner.graphs[r] = "graph"
        return "graph"

    monkeypatch.setattr(runner, "_capture", fake_capture)
    monkeypatch.setattr(runner, "device", types.SimpleNamespace(type="cuda"))
    assert runner.missing_sizes() == [1, 2, 4, 8, 9]
    rows = []
    monkeypatch.setattr(runner, "_run_model", rows.append)
    for forward in runner.forwards_to_capture():
        forward()
    assert rows == [4, 8, 16, 32, 36]  # padded requests x 4 rows each
    assert runner.capture_all() == 5 and seen == [1, 2, 4, 8, 9]
    assert runner.capture_all() == 0 and runner.missing_sizes() == [] and runner.forwards_to_capture() == []


def test_no_kernels_built_ahead_off_cuda():
    from laguna_dflash.engine.cuda_graph import build_kernels_ahead

    assert build_kernels_ahead([lambda: pytest.fail("recorded on the CPU")], torch.device("cpu")) == 0


def test_cuda_graph_capture_setting_is_checked():
    with pytest.raises(ValueError, match="--cuda-graph-capture"):
        EngineConfig(model="x", cuda_graph_capture="eager")


def test_can_run_only_decode_phase_shapes():
    from laguna_dflash.engine.kv_cache import KVCache

    kv = KVCache(1, 40, 4, 1, 8, torch.float32, "cpu")
    runner = CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=2,
                             max_model_len=100, max_tokens_per_request=4)
    decode = [ForwardItem(1, 5, 6, [0, 1]), ForwardItem(1, 2, 3, [2])]
    assert runner.can_run(decode, 2)
    assert not runner.can_run(decode + [ForwardItem(1, 0, 1, [3])], 3)  # above the largest batch
    assert not runner.can_run([ForwardItem(5, 0, 5, [0, 1])], 5)  # q above K + 1
    assert not runner.can_run([ForwardItem(2, 0, 2, [0]), ForwardItem(1, 0, 1, [1])], 3)  # mixed q
    assert not runner.can_run([ForwardItem(2, 0, 3, [0])], 2)  # chunk that does not end the sequence


@pytest.mark.parametrize("use_draft", [False, True])
def test_padded_runner_matches_unpadded_on_cpu(pair, use_draft):
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1) if use_draft else {}
    plain = LLM(target, block_size=4, max_num_seqs=6, **kw)
    padded = LLM(target, block_size=4, max_num_seqs=6, **kw)
    padded.engine.attach_graph_runners()
    for batch_size in (1, 3, 5):  # 3 and 5 pad to batch buckets 4 and 6
        prompts = _prompts(batch_size, seed=batch_size)
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
        got = [o.token_ids for o in padded.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, f"batch {batch_size}"


def _record_batches(runner, method: str, items_arg: int) -> list[int]:
    """Wrap ``runner.method`` to record the length of its positional argument ``items_arg``
    (the requests of each forward it takes) into the returned list."""
    sizes: list[int] = []
    original = getattr(runner, method)

    def recorded(*args, **kwargs):
        sizes.append(len(args[items_arg]))
        return original(*args, **kwargs)

    setattr(runner, method, recorded)
    return sizes


def test_cuda_graph_max_bs_caps_the_graphed_batches(pair):
    """``cuda_graph_max_bs`` caps every graph runner's padded batch sizes (target, drafter
    block, drafter context); a larger batch runs eagerly and gives the same tokens, a batch
    within the cap still takes the graph runners. A cap above ``max_num_seqs`` changes nothing."""
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=6)
    plain = LLM(target, **kw)
    capped = LLM(target, cuda_graph_max_bs=2, **kw)
    engine = capped.engine
    engine.attach_graph_runners()
    seen = [_record_batches(engine.runner.graphs, "forward", 1),  # forward(input_ids, items, ...)
            _record_batches(engine.proposer.runner.graphs, "forward", 1),
            _record_batches(engine.proposer.context_graphs, "run", 0)]  # run(pending, slots_of)
    assert engine.max_graph_batch_size == 2
    assert engine.runner.graphs.batch_sizes == engine.proposer.runner.graphs.batch_sizes == (1, 2)
    assert engine.proposer.context_graphs.batch_sizes == (1, 2)
    for batch_size in (5, 2):
        prompts = _prompts(batch_size, seed=11 + batch_size)
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
        for sizes in seen:
            sizes.clear()
        got = [o.token_ids for o in capped.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, f"batch {batch_size}"
        assert all(max(sizes, default=0) <= 2 for sizes in seen), (batch_size, seen)
        if batch_size == 2:  # the verify and the drafter block replay their graphs
            assert 2 in seen[0] and 2 in seen[1], seen
    assert LLM(target, cuda_graph_max_bs=64, **kw).engine.max_graph_batch_size == 6
    # unset: max_num_seqs, at most 256 (DEFAULT_CUDA_GRAPH_MAX_BS); a cap set above 256 holds
    assert LLM(target, **{**kw, "max_num_seqs": 300}).engine.max_graph_batch_size == 256
    assert EngineConfig(model="x", max_num_seqs=1024).graph_batch_cap == 256
    assert EngineConfig(model="x", max_num_seqs=1024, cuda_graph_max_bs=512).graph_batch_cap == 512
    assert EngineConfig(model="x", max_num_seqs=64).graph_batch_cap == 64
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        LLM(target, cuda_graph_max_bs=0, **kw)


def test_eager_warmup_batch_sizes():
    """Above the cap: the first eager size, the powers of two past it, ``max_num_seqs``."""
    from laguna_dflash.engine.engine import eager_warmup_batch_sizes

    assert eager_warmup_batch_sizes(16, 64) == (17, 32, 64)
    assert eager_warmup_batch_sizes(8, 64) == (9, 16, 32, 64)
    assert eager_warmup_batch_sizes(2, 6) == (3, 4, 6)
    assert eager_warmup_batch_sizes(31, 32) == (32,)
    assert eager_warmup_batch_sizes(64, 64) == eager_warmup_batch_sizes(6, 4) == ()
    # none past MAX_EAGER_WARMUP_BATCH (256), which stands in for the larger sizes; a first
    # eager size past it is served alone
    assert eager_warmup_batch_sizes(0, 10**6) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert eager_warmup_batch_sizes(100, 4096) == (101, 128, 256)
    assert eager_warmup_batch_sizes(300, 4096) == (301,)
    assert eager_warmup_batch_sizes(0, 200) == (1, 2, 4, 8, 16, 32, 64, 128, 200)


@pytest.mark.parametrize("mode", ["fixed K", "adaptive K", "target-only"])
def test_warmup_serves_the_eager_batches_above_cuda_graph_max_bs(pair, mode):
    """With ``cuda_graph_max_bs=2`` and 6 sequences the warm-up (run here on the CPU, where
    graphs are the padded forwards run eagerly) steps batches of 3, 4 and 6 requests at each
    draft level (adaptive K: 0, 1, 3, 5; fixed: K; target-only: 0), with short prompts and with
    prompts past two key splits; without the cap it steps none above 2. The engine then gives an
    unwarmed one's tokens, its counters reset."""
    target, draft = pair
    kw = dict(block_size=4, max_num_seqs=6)
    if mode != "target-only":
        kw.update(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, adaptive_k=mode == "adaptive K")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(5, seed=21)
    want = [o.token_ids for o in LLM(target, **kw).generate(prompt_token_ids=prompts, sampling_params=params)]
    for cap in (2, None):
        llm = LLM(target, cuda_graph_max_bs=cap, **kw)
        engine = llm.engine
        engine.attach_graph_runners()
        steps: list[tuple[int, int, int]] = []  # (requests, K, longest sequence)
        spec, plain = engine._spec_decode, engine._decode

        def spec_decode(seqs, k, ahead=None, spec=spec, steps=steps):
            steps.append((len(seqs), k, max(s.num_tokens for s in seqs)))
            return spec(seqs, k, ahead)

        def decode(seqs, ahead=None, plain=plain, steps=steps):
            steps.append((len(seqs), 0, max(s.num_tokens for s in seqs)))
            return plain(seqs, ahead)

        engine._spec_decode, engine._decode = spec_decode, decode
        engine.warmup()
        levels = {"fixed K": (BLOCK_SIZE - 1,), "adaptive K": (0, 1, 3, 5), "target-only": (0,)}[mode]
        eager = {(r, k) for r, k, _ in steps if r > 2}
        if cap is None:
            assert not eager, steps
            continue
        assert eager == {(r, k) for r in (3, 4, 6) for k in levels}, steps
        long = {r for r, _, n in steps if n > 128}  # past two splits of 64 keys
        assert long >= {3, 4, 6}, steps
        assert engine.timings.num_steps == 0 and not engine.has_unfinished
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want


def _drafter_caches(llm: LLM) -> list[torch.Tensor]:
    """Every drafter cache tensor without the scratch block (padding rows write there)."""
    kv = llm.engine.proposer.kv_cache
    return [c[: kv.scratch_slot] for layer in kv.layers for c in layer]


def test_padded_context_precompute_matches_eager_on_cpu(pair, monkeypatch):
    """The drafter's decode-step context K/V through the padded layouts run eagerly on CPU (what
    CUDA replays: ContextGraphRunner for the taps target-only steps leave pending, the verify
    graph's own store) equals the eager per-step precompute, and the context-graph path is
    really taken (prefill contexts stay eager). Without drafts ahead: their blocks write
    drafter K/V the eager engine never writes, at positions no block reads before rewriting."""
    from laguna_dflash.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "draft_ahead", False)
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=6)
    plain, padded = LLM(target, **kw), LLM(target, **kw)
    opted_out = LLM(target, graph_context_precompute=False, **kw).engine
    opted_out.attach_graph_runners()
    assert opted_out.proposer.context_graphs is None and opted_out.runner.graphs is not None
    padded.engine.attach_graph_runners()  # with the context graphs: on by default
    runner = padded.engine.proposer.context_graphs
    assert runner is not None
    calls = []
    original = runner.run
    runner.run = lambda pending, slots_of: (calls.append(len(pending)), original(pending, slots_of))
    prompts = _prompts(3, seed=7)
    for llm in (plain, padded):  # target-only steps between the speculative ones: pending taps
        llm.engine.k_policy = _Alternating(BLOCK_SIZE - 1)
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert calls and max(calls) == 3, calls
    for got, want in zip(_drafter_caches(padded), _drafter_caches(plain)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _AlwaysZero:
    """An adaptive-K policy stub that never drafts."""

    def choose(self, batch_size: int) -> int:
        return 0

    def expects_target_only(self, batch_size: int) -> bool:
        return True

    def observe(self, *args) -> None:
        pass


def test_target_only_steps_keep_the_drafter_context_bounded(pair):
    """With K = 0 chosen step after step, pending taps are stored every K + 1 rows (not kept
    growing), the output is the target's, and the stored context equals the eager path's."""
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=6)
    base = LLM(target, block_size=4, max_num_seqs=6)
    plain, padded = LLM(target, **kw), LLM(target, **kw)
    padded.engine.attach_graph_runners()
    padded.engine.attach_context_graphs()
    prompts = _prompts(3, seed=5)
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
    for llm in (plain, padded):
        engine = llm.engine
        engine.k_policy = _AlwaysZero()
        seen = []
        decode = engine._decode

        def watched(seqs, *args, decode=decode, seen=seen):
            out = decode(seqs, *args)
            seen.extend(s.num_pending for s in seqs if s.num_pending)
            return out

        engine._decode = watched
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want
        assert seen and max(seen) <= BLOCK_SIZE - 1, seen  # stored on reaching K + 1 rows
    for got, want_cache in zip(_drafter_caches(padded), _drafter_caches(plain)):
        torch.testing.assert_close(got, want_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adaptive", [False, True])
def test_warmup_leaves_no_trace(pair, adaptive):
    """The warm-up (run at start on CUDA) serves and forgets two requests: counters are zero, every
    KV block is free again, and the next requests get what a fresh engine gives."""
    target, draft = pair
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=6,
              adaptive_k=adaptive)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    fresh, warmed = LLM(target, **kw), LLM(target, **kw)
    engine = warmed.engine
    engine.warmup()
    metrics = warmed.get_metrics()
    assert metrics["num_steps"] == metrics["num_prefill_tokens"] == metrics["num_drafts"] == 0
    assert not engine.has_unfinished
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert (engine.k_policy is not None) == adaptive
    prompts = _prompts(3, seed=2)
    want = fresh.generate(prompt_token_ids=prompts, sampling_params=params)
    got = warmed.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert warmed.get_metrics()["num_drafts"] == fresh.get_metrics()["num_drafts"]


def test_warmup_drafts_at_every_adaptive_k_level(pair, monkeypatch):
    """With adaptive K the warm-up drafts at each K the policy may choose (its levels), so the
    start-up capture that follows it on CUDA holds every verify and drafter-block shape; the
    policy is then a fresh :class:`AdaptiveK` again."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, adaptive_k=True)
    engine = llm.engine
    drafted: list[int] = []
    spec_decode = engine._spec_decode

    def watched(seqs, k, *args):
        drafted.append(k)
        return spec_decode(seqs, k, *args)

    monkeypatch.setattr(engine, "_spec_decode", watched)
    engine.warmup()
    levels = engine.k_policy.levels
    assert len(levels) > 3 and set(drafted) == set(levels[1:]), (drafted, levels)
    assert type(engine.k_policy) is AdaptiveK and engine.k_policy.num_steps == 0


def _spy_warmup(engine, monkeypatch) -> tuple[list[int], list[list[int]]]:
    """Record the prompt lengths the engine is given and, per prefill, its prompts' lengths."""
    lengths: list[int] = []
    prefills: list[list[int]] = []
    add, prefill = engine.add_request, engine._prefill

    def add_request(ids, *args, **kwargs):
        lengths.append(len(ids))
        return add(ids, *args, **kwargs)

    def run_prefill(seqs, num_new_tokens):
        prefills.append(sorted(len(s.prompt_token_ids) for s in seqs))
        return prefill(seqs, num_new_tokens)

    monkeypatch.setattr(engine, "add_request", add_request)
    monkeypatch.setattr(engine, "_prefill", run_prefill)
    return lengths, prefills


def test_enforce_eager_warmup_serves_eager_batches_of_every_size(pair, monkeypatch):
    """Under ``enforce_eager`` (on CUDA: here the device check is faked and the requests are
    recorded, not run) the warm-up serves the eager batches of sizes 1, 2, 4, ...,
    ``max_num_seqs``, each of short and of two-split prompts; an engine without graphs that is
    not ``enforce_eager`` (a CPU one) serves none."""
    from laguna_dflash.engine import engine as engine_module

    target, _ = pair
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long = 2 * engine_module.paged_attention._MIN_SPLIT_KEYS + 8
    for eager, want in ((True, [(r, n) for n in (8, long) for r in (1, 2, 4, 5)]), (False, [])):
        llm = LLM(target, max_num_seqs=5, max_model_len=400, enforce_eager=eager)
        engine, served = llm.engine, []
        monkeypatch.setattr(engine, "_serve_to_the_end",
                            lambda prompts, p, served=served: served.append((len(prompts), len(prompts[0]))))
        monkeypatch.setattr(engine, "device", type("FakeCuda", (), {"type": "cuda"})())
        engine._warmup_eager_batches(params)
        assert served == want, eager


@pytest.mark.full_warmup
def test_warmup_prefills_the_listed_prompt_shapes_in_half_precision(pair, monkeypatch):
    """bf16: after its two decoding requests the warm-up prefills every shape of
    WARMUP_PREFILL_LENGTHS that the engine can hold (two-prompt shapes in one prefill), and
    leaves no trace; float32 runs the two decoding requests only."""
    from laguna_dflash.engine import engine as engine_module

    target, draft = pair
    shapes = engine_module.WARMUP_PREFILL_LENGTHS
    for dtype, want in (("bfloat16", shapes), ("float32", ())):
        llm = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, dtype=dtype,
                  max_num_seqs=2, max_model_len=400)
        lengths, prefills = _spy_warmup(llm.engine, monkeypatch)
        llm.engine.warmup()
        assert lengths == [8, 16] + [n for shape in want for n in shape], dtype
        assert prefills == [[8], [16]] + [sorted(shape) for shape in want], dtype
        metrics = llm.get_metrics()
        assert metrics["num_steps"] == metrics["num_prefill_tokens"] == 0
        assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
    # a shape the engine cannot hold is skipped: two prompts with max_num_seqs=1
    llm = LLM(target, dtype="bfloat16", max_num_seqs=1, max_model_len=400)
    lengths, _ = _spy_warmup(llm.engine, monkeypatch)
    llm.engine.warmup()
    assert lengths == [8, 16] + [n for shape in shapes if len(shape) == 1 for n in shape]


@needs_cuda
@pytest.mark.parametrize("use_draft", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager_on_cuda(pair, use_draft, dtype):
    """Replayed graphs give the eager engine's tokens (same kernels, same shapes per request)."""
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1) if use_draft else {}
    eager = LLM(target, device="cuda", dtype=dtype, enforce_eager=True, max_num_seqs=8, **kw)
    graphed = LLM(target, device="cuda", dtype=dtype, max_num_seqs=8, **kw)
    assert graphed.engine.runner.graphs is not None
    for batch_size in (1, 3, 5):  # batch buckets 1, 4, 8: padded and unpadded
        prompts = _prompts(batch_size, seed=batch_size)
        want = [o.token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=params)]
        got = [o.token_ids for o in graphed.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, f"batch {batch_size}"
    assert graphed.engine.runner.graphs.graphs, "no graph was captured"


@needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs sm90+")
def test_programmatic_dependent_launch_keeps_the_tokens_on_cuda(pair, monkeypatch):
    """``kernels.pdl.USE_PDL`` only changes when kernels start, never what they compute: the
    graphed engine (its Triton kernels launched early, waiting on their inputs) gives the same
    bf16 tokens as without it, target-only and speculative, at batch 1, 3 and 5; and the same
    draft tokens at every step (the drafter's context K/V, attention and MoE-free layers: a race
    there would change drafts, not the verified output)."""
    from laguna_dflash.kernels import pdl

    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for kw in ({}, dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, trace=True)):
        llm = LLM(target, device="cuda", dtype="bfloat16", max_num_seqs=8, **kw)
        engine = llm.engine
        runners = [engine.runner] + ([engine.proposer.runner] if engine.proposer else [])
        want, got = [], []
        for use_pdl, out in ((False, want), (True, got)):
            monkeypatch.setattr(pdl, "USE_PDL", use_pdl)
            for r in runners:
                r.graphs.reset()  # recapture with the launches of this setting
            if engine.proposer is not None and engine.proposer.context_graphs is not None:
                engine.proposer.context_graphs.graphs.clear()
            for batch_size in (1, 3, 5):
                prompts = _prompts(batch_size, seed=batch_size)
                for o in llm.generate(prompt_token_ids=prompts, sampling_params=params):
                    drafts = [step["draft_tokens"] for step in o.metrics.get("trace", [])]
                    out.append((o.token_ids, drafts))
        assert got == want
        if engine.proposer is not None:
            assert any(drafts for _, drafts in want)  # the drafts were really compared


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_context_precompute_matches_eager_on_cuda(pair, dtype, monkeypatch):
    """The replayed drafter-context graph (the taps target-only steps leave pending) and the
    verify graph's own context store write the eager engine's drafter caches (drafts ahead off:
    their blocks write where the eager engine does not)."""
    from laguna_dflash.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "draft_ahead", False)
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, max_num_seqs=8, dtype=dtype)
    # the caches are compared whole, so both engines must warm up alike: an enforce_eager
    # engine's warm-up also serves eager batches of every size (the graphed one's, none at
    # max_num_seqs = cuda_graph_max_bs), which leave other K/V in blocks the requests below
    # do not write and free the blocks in another order
    with monkeypatch.context() as m:
        m.setattr(engine_module.LLMEngine, "_warmup_eager_batches", lambda self, params: None)
        eager = LLM(target, device="cuda", enforce_eager=True, **kw)
    graphed = LLM(target, device="cuda", graph_context_precompute=True, **kw)
    prompts = _prompts(5, seed=11)
    for llm in (eager, graphed):
        llm.engine.k_policy = _Alternating(BLOCK_SIZE - 1)
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    runner = graphed.engine.proposer.context_graphs
    assert runner.graphs and not runner.is_broken
    tol = 1e-5 if dtype == "float32" else 3e-2
    for got, want in zip(_drafter_caches(graphed), _drafter_caches(eager)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_cuda
@pytest.mark.parametrize("adaptive", [False, True])
def test_startup_capture_leaves_no_capture_for_later_steps_on_cuda(pair, adaptive):
    """With ``cuda_graph_capture="startup"`` every batch size and key bucket is captured before
    the first request, so serving batches of every size past a key bucket (256 keys) captures
    nothing new (adaptive K too: the warm-up drafted at each K it may choose), and the tokens
    are the lazily captured engine's (float32: the same kernels either way)."""
    target, draft = pair
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda", max_num_seqs=5,
              max_model_len=400, adaptive_k=adaptive)
    lazy = LLM(target, cuda_graph_capture="lazy", **kw)
    at_start = LLM(target, **kw)
    engine = at_start.engine
    runners = [engine.runner.graphs, engine.proposer.runner.graphs]
    ctx = engine.proposer.context_graphs
    counts = [len(r.graphs) for r in runners] + [len(ctx.graphs)]
    sizes = len(runners[0].batch_sizes)  # 1, 2, 4, 5
    # target (verify), drafter block: every size x the buckets up to 400 + K keys; context: sizes
    assert counts[0] >= sizes * 2 and counts[1] >= sizes * 2 and counts[2] == sizes
    chosen = []
    if adaptive:  # the policy's choices, recorded
        choose = engine.k_policy.choose
        engine.k_policy.choose = lambda n: chosen.append(choose(n)) or chosen[-1]
    _assert_same_greedy_tokens(lazy, at_start, (1, 3, 5), seed=3, length=230, step=7)
    assert [len(r.graphs) for r in runners] + [len(ctx.graphs)] == counts, "a step captured"
    assert not adaptive or len(set(chosen)) >= 2, set(chosen)
    assert len(lazy.engine.runner.graphs.graphs) < counts[0]


@needs_cuda
def test_startup_capture_stops_at_cuda_graph_max_bs_on_cuda(pair):
    """With ``cuda_graph_max_bs=2`` start-up captures batch sizes 1 and 2 only (fewer graphs
    than without the cap); batches of 3 and 5 then run eagerly, capture nothing, and give the
    uncapped engine's tokens (float32: the same kernels either way)."""
    target, draft = pair
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda", max_num_seqs=5,
              max_model_len=400)
    full = LLM(target, **kw)
    capped = LLM(target, cuda_graph_max_bs=2, **kw)

    def graphs_of(llm: LLM) -> list[dict]:
        e = llm.engine
        return [e.runner.graphs.graphs, e.proposer.runner.graphs.graphs, e.proposer.context_graphs.graphs]

    counts = [len(g) for g in graphs_of(capped)]
    assert all(c < f for c, f in zip(counts, (len(g) for g in graphs_of(full)))), counts
    assert all(key[0] <= 2 for g in graphs_of(capped)[:2] for key in g)
    assert set(graphs_of(capped)[2]) == {1, 2}
    _assert_same_greedy_tokens(full, capped, (1, 3, 5), seed=4, length=230, step=7)
    assert [len(g) for g in graphs_of(capped)] == counts, "a step captured"


def _decode_step_builds(make_llm, batches, params, monkeypatch) -> list[str]:
    """Every in-memory Triton variant of the process forgotten, ``make_llm()`` built (its
    start-up and warm-up build what they build), then ``batches`` generated: the Triton builds
    made inside decode steps (``_decode`` / ``_spec_decode``; a prefill's are not counted)."""
    import gc

    import triton
    from triton.runtime.jit import JITFunction

    for obj in gc.get_objects():
        if issubclass(type(obj), JITFunction):
            obj.device_caches.clear()
    llm = make_llm()
    engine, built, state = llm.engine, [], {"decoding": False}

    def flagged(step):
        def wrapped(*args, **kwargs):
            state["decoding"] = True
            try:
                return step(*args, **kwargs)
            finally:
                state["decoding"] = False
        return wrapped

    engine._spec_decode, engine._decode = flagged(engine._spec_decode), flagged(engine._decode)
    with monkeypatch.context() as m:
        m.setattr(triton.knobs.runtime, "jit_cache_hook",
                  lambda **kw_: state["decoding"] and built.append(kw_["repr"][:120]) and False)
        for prompts in batches:
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
    del llm, engine
    gc.collect()
    return built


@needs_cuda
def test_eager_batches_above_cuda_graph_max_bs_build_no_triton_kernel_on_cuda(pair, monkeypatch):
    """With ``cuda_graph_max_bs=2`` the warm-up serves eager batches above the cap
    (``engine.warmup_eager_batches``), so that the decode steps of batches of 3..6 requests
    (short prompts, and 3 past two key splits) build no Triton kernel; with the switch off they
    build some (reported, not asserted: that count is the test model's). Every in-memory
    variant is forgotten before each engine, so that the check can fail."""
    from laguna_dflash.engine import engine as engine_module

    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rng = random.Random(8)
    batches = [[[rng.randrange(0, 60) for _ in range(n + i)] for i in range(r)]
               for r, n in ((3, 20), (4, 18), (6, 16), (5, 22), (3, 136))]
    built: dict[bool, list[str]] = {}
    for warm in (False, True):
        monkeypatch.setattr(engine_module, "warmup_eager_batches", warm)
        built[warm] = _decode_step_builds(
            lambda: LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda",
                        dtype="bfloat16", max_num_seqs=6, max_model_len=400, cuda_graph_max_bs=2),
            batches, params, monkeypatch)
    assert not built[True], (built[True], f"switch off: {len(built[False])} builds")


@needs_cuda
def test_eager_engine_decodes_growing_contexts_building_no_triton_kernel_on_cuda(pair, monkeypatch):
    """Under ``enforce_eager`` the warm-up serves eager batches too, and eager forwards split the
    keys into one fixed count (``triton_attention.fixed_eager_splits``): decoding a request and a
    pair of them from 20 to 400 keys (the split count would follow the key length, a variant
    every 64 keys) builds no Triton kernel in a decode step. With the fixed count off the same
    decodes do build (asserted, so the check can fail). Every in-memory variant is forgotten
    before each engine."""
    from laguna_dflash.engine import triton_attention

    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=380, ignore_eos=True)
    rng = random.Random(9)
    batches = [[[rng.randrange(0, 60) for _ in range(20 + i)] for i in range(r)] for r in (1, 2)]
    built: dict[bool, list[str]] = {}
    for fixed in (True, False):
        monkeypatch.setattr(triton_attention, "fixed_eager_splits", fixed)
        built[fixed] = _decode_step_builds(
            lambda: LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda",
                        dtype="bfloat16", max_num_seqs=2, max_model_len=512, enforce_eager=True),
            batches, params, monkeypatch)
    assert not built[True], built[True]
    assert any("attention" in b for b in built[False]), built[False]


@needs_cuda
def test_startup_capture_empties_the_allocator_cache_once_on_cuda(pair, monkeypatch):
    """Start-up capture (cuda_graph.captures_in_a_row) empties the allocator's cache before its
    first capture and after its last only, where torch.cuda.graph empties it before every
    capture, and runs one eager warm-up per capture; its graphs give the tokens of an engine
    captured the old way (every capture emptying the cache, two warm-ups each)."""
    from laguna_dflash.engine import cuda_graph

    target, draft = pair
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda", max_num_seqs=5,
              max_model_len=400)
    calls, inside = [], [False]
    empty_cache, in_a_row = torch.cuda.empty_cache, cuda_graph.captures_in_a_row

    def counted_empty_cache() -> None:
        calls.append(inside[0])
        empty_cache()

    @contextlib.contextmanager
    def flagged(device):  # the scope's own emptying at its end counts as inside
        inside[0] = True
        try:
            with in_a_row(device):
                yield
        finally:
            inside[0] = False

    monkeypatch.setattr(torch.cuda, "empty_cache", counted_empty_cache)
    monkeypatch.setattr(cuda_graph, "captures_in_a_row", flagged)
    monkeypatch.setattr(cuda_graph, "keep_cache_between_captures", False)
    monkeypatch.setattr(cuda_graph, "num_capture_warmups", 2)
    every = LLM(target, **kw)
    num_old = sum(calls)
    calls.clear()
    monkeypatch.setattr(cuda_graph, "keep_cache_between_captures", True)
    monkeypatch.setattr(cuda_graph, "num_capture_warmups", 1)
    once = LLM(target, **kw)
    num_graphs = (len(once.engine.runner.graphs.graphs) + len(once.engine.proposer.runner.graphs.graphs)
                  + len(once.engine.proposer.context_graphs.graphs))
    assert num_graphs >= 10 and num_old >= 10, (num_graphs, num_old)
    assert sum(calls) == 2, calls  # before the first capture, after the last
    _assert_same_greedy_tokens(every, once, (1, 3, 5), seed=5, length=230, step=7)


@needs_cuda
def test_startup_capture_warmups_reuse_their_cached_blocks_on_cuda(pair, monkeypatch):
    """Every capture's warm-ups run on one stream, so a capture reuses the blocks the previous
    one's warm-ups freed: the allocator reuses a cached block on its own stream only, and the
    start-up capture keeps the cache until its end. Just before that end, torch's regular
    pools hold segments of a few streams (default, warm-up), not one per capture as with a
    stream per capture (each capture's warm-ups then took new segments: the likely cause of
    the thirty-ninth pass's 10 GiB start-up peak). Not yet run on a GPU."""
    from laguna_dflash.engine import cuda_graph

    target, draft = pair
    streams, in_a_row = [], cuda_graph.captures_in_a_row

    @contextlib.contextmanager
    def snapshot_at_the_end(device):
        with in_a_row(device):
            yield
            streams.append({seg["stream"] for seg in torch.cuda.memory_snapshot()
                            if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0)})

    monkeypatch.setattr(cuda_graph, "captures_in_a_row", snapshot_at_the_end)
    llm = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda",
              max_num_seqs=5, max_model_len=400)
    engine = llm.engine
    num_graphs = (len(engine.runner.graphs.graphs) + len(engine.proposer.runner.graphs.graphs)
                  + len(engine.proposer.context_graphs.graphs))
    assert num_graphs >= 10 and streams, (num_graphs, streams)
    assert max(len(s) for s in streams) <= 3, [len(s) for s in streams]


@needs_cuda
def test_startup_capture_builds_its_kernels_ahead_on_cuda(pair, monkeypatch):
    """Start-up capture first builds every Triton kernel its graphs launch, in parallel, from
    forwards recorded into throwaway graphs (cuda_graph.build_kernels_ahead): the captures after
    it build nothing, the workspaces the pass touched are intact, and the tokens are those of an
    engine whose captures built each kernel when they first launched it (built after this one,
    so this engine is the first to see its new shapes)."""
    import triton

    from laguna_dflash.engine import cuda_graph
    from laguna_dflash.engine import engine as engine_module
    from laguna_dflash.engine.context_graph import ContextGraphRunner

    target, draft = pair
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda", max_num_seqs=6,
              max_model_len=512)
    submitted, misses, inside = [], [], [False]
    build = engine_module.build_kernels_ahead

    def build_and_count(forwards, device):
        submitted.append(build(forwards, device))
        return submitted[-1]

    def counting(capture_all):
        def wrapped(*args, **kwargs):
            inside[0] = True
            try:
                return capture_all(*args, **kwargs)
            finally:
                inside[0] = False
        return wrapped

    def on_miss(**_):  # Triton calls it when a launch finds no built variant in memory
        if inside[0]:
            misses.append(1)
        return False

    monkeypatch.setattr(engine_module, "build_kernels_ahead", build_and_count)
    monkeypatch.setattr(CUDAGraphRunner, "capture_all", counting(CUDAGraphRunner.capture_all))
    monkeypatch.setattr(ContextGraphRunner, "capture_all", counting(ContextGraphRunner.capture_all))
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", on_miss)
    ahead = LLM(target, **kw)
    assert len(submitted) == 1 and not misses, f"{len(misses)} builds inside the captures"
    monkeypatch.setattr(cuda_graph, "build_ahead", False)
    one_by_one = LLM(target, **kw)
    assert len(submitted) == 1  # the switch turns the pass off
    _assert_same_greedy_tokens(one_by_one, ahead, (1, 3, 6), seed=5, length=250, step=9)


_FRESH_ENGINE = """
import logging, sys
from laguna_dflash import LLM
records = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda r: records.append(r.getMessage())
logging.getLogger("laguna_dflash").addHandler(handler)
LLM(sys.argv[1], draft=sys.argv[2], num_speculative_tokens=int(sys.argv[3]), device="cuda",
    dtype="float32", max_num_seqs=2, max_model_len=256)
print("WARNINGS", [m.splitlines()[0] for m in records])
"""


@needs_cuda
def test_fresh_float32_engine_builds_its_first_forward_ahead(pair):
    """In a fresh process (no cuBLAS handle yet) a float32 engine's warm-up records its first
    forward to build its kernels ahead without a warning: that recording was the process's first
    cuBLAS use, which invalidated it ("building kernels ahead stopped after 0 of 1 forwards",
    twenty-eighth and thirty-third passes), until cuda_graph._blas_ready."""
    import subprocess
    import sys

    target, draft = pair
    done = subprocess.run([sys.executable, "-c", _FRESH_ENGINE, str(target), str(draft), str(BLOCK_SIZE - 1)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stdout.splitlines() if line.startswith("WARNINGS")]
    assert warnings == ["WARNINGS []"], warnings


@needs_cuda
@pytest.mark.parametrize("use_draft", [False, True])
def test_first_sampled_requests_build_no_triton_kernel_on_cuda(pair, monkeypatch, use_draft):
    """Start-up builds what a sampled step launches and a greedy one does not
    (``sampler.build_ahead``: the race's float32 argmax, the top-k values kernels): after a
    greedy request, the same prompt sampled with temperature, top-k, top-k + top-p, seeded
    top-p, min-p and a top-k near the vocabulary (64) finds every Triton kernel built. Every
    variant of the process is forgotten before start-up, so that the check can fail."""
    import gc

    import triton
    from triton.runtime.jit import JITFunction

    target, draft = pair
    for obj in gc.get_objects():  # in-memory variants only (as in the test below)
        if issubclass(type(obj), JITFunction):
            obj.device_caches.clear()
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1) if use_draft else {}
    llm = LLM(target, device="cuda", dtype="bfloat16", max_num_seqs=2, **kw)
    prompt = _prompts(3, seed=4)[2:]
    llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True))
    built = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook",
                        lambda **kw_: built.append(kw_["repr"][:160]) and False)
    for params in (dict(temperature=0.7), dict(temperature=0.7, top_k=20),
                   dict(temperature=0.7, top_k=50, top_p=0.9), dict(temperature=0.7, top_p=0.9, seed=3),
                   dict(temperature=1.0, min_p=0.1), dict(temperature=0.7, top_k=60)):
        llm.generate(prompt_token_ids=prompt,
                     sampling_params=SamplingParams(**params, max_tokens=12, ignore_eos=True))
    assert not built, built


@needs_cuda
def test_first_long_eager_prefills_build_no_sorted_moe_kernel_on_cuda(tmp_path, monkeypatch):
    """Start-up builds the sorted MoE kernels at every tile height
    (``layers.build_sorted_moe_kernels_ahead``): an eager engine's first prompts of 800 and 1900
    tokens (past 256 pairs; 64- and 128-row tiles) build none of them. Without that build they
    do, so the check can fail. Every variant of the process is forgotten before each start-up."""
    import gc

    import dflash_fixtures as df
    import triton
    from triton.runtime.jit import JITFunction

    from laguna_dflash.engine import engine as engine_module

    target = df.make_tiny_laguna_target(tmp_path / "laguna", seed=0, max_position_embeddings=2048)
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (800, 1900)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for ahead in (True, False):
        for obj in gc.get_objects():
            if issubclass(type(obj), JITFunction):
                obj.device_caches.clear()
        if not ahead:
            monkeypatch.setattr(engine_module, "build_sorted_moe_kernels_ahead", lambda model: 0)
        llm = LLM(target, device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=1,
                  max_model_len=2048)
        built = []
        with monkeypatch.context() as m:
            m.setattr(triton.knobs.runtime, "jit_cache_hook",
                      lambda built=built, **kw_: built.append(kw_["repr"][:160]) and False)
            for prompt in prompts:
                llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        sorted_built = [b for b in built if "_sorted_" in b]
        assert bool(sorted_built) is not ahead, (ahead, sorted_built)
        del llm
        gc.collect()


@needs_cuda
def test_first_use_captures_build_their_kernels_ahead_on_cuda(pair, monkeypatch):
    """A capture made on first use (lazy capture; the warm-up's batch-1 graphs) first builds the
    Triton kernels of its one forward in parallel (cuda_graph.build_kernels_ahead): the
    capture's own runs then build nothing, and the tokens are the eager engine's. Every kernel
    variant of the process is forgotten first, so each capture has kernels to build."""
    import contextlib
    import gc

    import triton
    from triton.runtime.jit import JITFunction

    from laguna_dflash.engine import cuda_graph

    target, draft = pair
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, device="cuda", max_num_seqs=6,
              max_model_len=512)
    eager = LLM(target, enforce_eager=True, **kw)
    for obj in gc.get_objects():  # in-memory variants only: the on-disk cache makes reloads quick
        if issubclass(type(obj), JITFunction):  # type(): isinstance would fail on a dead weakproxy
            obj.device_caches.clear()
    calls, misses, state = [], [], {"building": False, "capturing": 0}
    build, building_graph = cuda_graph.build_kernels_ahead, cuda_graph.building_cuda_graph

    def build_and_count(forwards, device):
        state["building"] = True
        try:
            calls.append((len(forwards), build(forwards, device)))
        finally:
            state["building"] = False
        return calls[-1][1]

    @contextlib.contextmanager
    def capturing():  # capture_graph's warm-up runs and capture (and the build's recordings)
        with building_graph():
            state["capturing"] += 1
            try:
                yield
            finally:
                state["capturing"] -= 1

    def on_miss(**_):  # Triton calls it when a launch finds no built variant in memory
        if state["capturing"] and not state["building"]:
            misses.append(1)
        return False

    monkeypatch.setattr(cuda_graph, "build_kernels_ahead", build_and_count)
    monkeypatch.setattr(cuda_graph, "building_cuda_graph", capturing)
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", on_miss)
    warnings = _WarningList()  # a recording that stopped; a torch.compile turned off for good
    logging.getLogger("laguna_dflash").addHandler(warnings)
    try:
        lazy = LLM(target, cuda_graph_capture="lazy", **kw)
        _assert_same_greedy_tokens(eager, lazy, (1, 3, 6), seed=7, length=250, step=9)
    finally:
        logging.getLogger("laguna_dflash").removeHandler(warnings)
    assert not warnings.messages, warnings.messages
    engine = lazy.engine
    runners = [engine.runner.graphs, engine.proposer.runner.graphs]
    num_captured = sum(len(r.graphs) for r in runners) + len(engine.proposer.context_graphs.graphs)
    assert num_captured >= 6  # batch 1, 3 -> 4 and 6, a verify and a drafter block each, ...
    assert [n for n, _ in calls] == [1] * num_captured, "one build of one forward per capture"
    assert sum(built for _, built in calls) > 0 and not misses, f"{len(misses)} builds in captures"


@needs_cuda
def test_graphed_spec_is_lossless_in_float32(pair):
    """With graphs on, float32 speculation on the GPU equals float32 target-only decoding."""
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(target, device="cuda", max_num_seqs=8)
    spec = LLM(target, draft=draft, device="cuda", num_speculative_tokens=BLOCK_SIZE - 1, max_num_seqs=8)
    for batch_size in (1, 3, 5):
        prompts = _prompts(batch_size, seed=10 + batch_size)
        want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
        got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, f"batch {batch_size}"


@needs_cuda
def test_float32_verify_past_the_fused_moe_pair_limit_is_captured(pair, monkeypatch):
    """float32 has no grouped GEMM, so a forward with more pairs than ``fused_moe_max_pairs``
    (a verify of several sequences) used the per-expert loop, which syncs with the host and
    failed the CUDA-graph capture (found serving XS-2.1 widths in float32). Now the fused
    kernels take it: graphed speculation still equals target-only."""
    from laguna_dflash.models.layers import MoE

    monkeypatch.setattr(MoE, "fused_moe_max_pairs", 8)  # every verify here is past it
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = LLM(target, device="cuda", max_num_seqs=8)
    spec = LLM(target, draft=draft, device="cuda", num_speculative_tokens=BLOCK_SIZE - 1, max_num_seqs=8)
    prompts = _prompts(5, seed=21)
    want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    # the verify forwards (q > 1 tokens a sequence, several sequences) were graphed
    assert any(r_pad > 1 and q > 1 for r_pad, q, *_ in spec.engine.runner.graphs.graphs)


@needs_cuda
def test_fused_elementwise_chains_match_eager_on_cuda():
    """Each torch.compile'd chain (models/fusion.py) equals its eager body in float32."""
    from laguna_dflash.models import fusion as f

    g = torch.Generator("cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    pos = torch.tensor([0, 3, 17, 250, 9], device="cuda")
    cases = [
        (f.rms_norm, (rnd(5, 256), rnd(256), 1e-6)),
        (f.add_rms_norm, (rnd(5, 256), rnd(5, 256), rnd(256), 1e-6)),
        (f.rope, (rnd(5, 4, 64), rnd(256, 32), rnd(256, 32), pos, 32)),
        (f.rms_norm_rope, (rnd(5, 4, 64), rnd(64), 1e-6, rnd(256, 64), rnd(256, 64), pos, 64)),
        (f.softplus_gate, (rnd(5, 4, 64), rnd(5, 4, 1))),
        (f.silu_mul, (rnd(5, 128),)),
        (f.scale_add, (rnd(5, 256), 2.5, rnd(5, 256))),
        (f.rms_norm_unweighted, (rnd(5, 256), 1e-6)),
        (f.rms_norm_grouped, (rnd(3, 5, 64), rnd(3, 64), 1e-6)),
        (f.rms_norm_interleaved, (rnd(5, 3 * 64), rnd(3, 64), 1e-6)),
        (f.moe_route, (rnd(5, 16), rnd(16), 4, 0.0, "sigmoid", True)),
    ]
    with torch.inference_mode():
        for fn, args in cases:
            got, want = fn(*args), fn.eager(*args)
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=fn.__name__)


def test_cpu_engine_uses_sdpa_and_no_graphs(pair):
    """``attention_backend="auto"`` is the torch SDPA reference on CPU, and graphs are CUDA-only."""
    target, _ = pair
    llm = LLM(target, block_size=4)
    assert llm.engine.backend.name == "torch_sdpa"
    assert llm.engine.runner.graphs is None


def test_enforce_eager_flag_parses():
    from laguna_dflash.cli import build_parser

    args = build_parser().parse_args(["generate", "x", "--model", "m", "--enforce-eager"])
    assert args.enforce_eager is True
    assert build_parser().parse_args(["generate", "x", "--model", "m"]).enforce_eager is False


def test_pending_rows_gather_per_source():
    """Pending taps referencing several source tensors (a verify step's rows, then target-only
    steps' rows) are gathered in request and position order: eagerly and into a padded layout."""
    from laguna_dflash.config import SamplingParams as SP
    from laguna_dflash.engine.pending_taps import copy_rows, gather_pending_taps, plan_rows
    from laguna_dflash.engine.sequence import Sequence

    g = torch.Generator().manual_seed(0)
    verify, step1, step2 = (torch.randn(n, 5, generator=g) for n in (8, 2, 2))
    a, b = Sequence(0, [1], SP()), Sequence(1, [1], SP())
    a.add_pending_taps(verify, 0, 3, 10)
    a.add_pending_taps(step1, 0, 1, 13)
    a.add_pending_taps(step2, 0, 1, 14)
    b.add_pending_taps(verify, 4, 2, 20)
    b.add_pending_taps(step1, 1, 1, 22)
    want_a = torch.cat([verify[0:3], step1[0:1], step2[0:1]])
    want_b = torch.cat([verify[4:6], step1[1:2]])
    sources, rows = plan_rows([a, b], [0, 5])
    got = gather_pending_taps([a, b], torch.from_numpy(rows), rows, sources)
    torch.testing.assert_close(got, torch.cat([want_a, want_b]), rtol=0, atol=0)
    sources, rows = plan_rows([a, b], [0, 8])  # padded: request i at row 8 * i
    dest = torch.zeros(16, 5)
    copy_rows(dest, sources, torch.from_numpy(rows))
    torch.testing.assert_close(dest[:5], want_a, rtol=0, atol=0)
    torch.testing.assert_close(dest[8:11], want_b, rtol=0, atol=0)
    assert dest[5:8].abs().sum() == 0 and dest[11:].abs().sum() == 0
    c = Sequence(2, [1], SP())  # one contiguous run of one source: a view, no copy
    c.add_pending_taps(verify, 2, 4, 0)
    sources, rows = plan_rows([c], [0])
    got = gather_pending_taps([c], torch.from_numpy(rows), rows, sources)
    assert got.data_ptr() == verify[2].data_ptr() and got.shape == (4, 5)
    d, e = Sequence(3, [1], SP()), Sequence(4, [1], SP())  # one source, rows apart: a verify step
    d.add_pending_taps(verify, 1, 1, 0)
    e.add_pending_taps(verify, 5, 2, 0)
    sources, rows = plan_rows([d, e], [0, 1])
    got = gather_pending_taps([d, e], torch.from_numpy(rows), rows, sources)
    torch.testing.assert_close(got, verify[[1, 5, 6]], rtol=0, atol=0)
    with pytest.raises(AssertionError, match="contiguous"):
        c.add_pending_taps(step1, 0, 1, 7)


class _Alternating:
    """An adaptive-K policy stub: target-only steps in runs of 1, 2 and 3, then a full draft."""

    def __init__(self, k: int) -> None:
        self.k, self.pattern, self.step = k, [0, k, 0, 0, k, 0, 0, 0, k], 0

    def choose(self, batch_size: int) -> int:
        self.step += 1
        return self.pattern[self.step % len(self.pattern)]

    def expects_target_only(self, batch_size: int) -> bool:  # the next choose(), exactly
        return self.pattern[(self.step + 1) % len(self.pattern)] == 0

    def observe(self, *args) -> None:
        pass


@pytest.mark.parametrize("in_verify", [True, False])
@pytest.mark.parametrize("context_graphs", [False, True])
def test_drafter_reads_only_the_taps_of_committed_positions(pair, context_graphs, in_verify, monkeypatch):
    """Switching between target-only and speculative steps, every context row a drafter block
    can see (the positions before its anchor within its window: the drafter's sliding layers
    keep their context in a sliding group of the hybrid layout) was last written with the target's tap row of that
    position (the taps of a full prefill of the final sequence), eagerly or through the padded
    layouts; the verify's own store also writes rows of rejected drafts (checked: some are), at
    positions no block reads before rewriting them (``in_verify``; else only committed rows are
    stored, as pending taps). Blocks queued ahead read at the anchors the device computed. The
    output is the target's."""
    from laguna_dflash.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "store_context_in_verify", in_verify)
    target, draft = pair
    k = BLOCK_SIZE - 1
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(3, seed=11)
    want = [o.token_ids for o in LLM(target, block_size=4, max_num_seqs=4)
            .generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(target, draft=draft, num_speculative_tokens=k, block_size=4, max_num_seqs=4)
    engine = llm.engine
    if context_graphs:
        engine.attach_graph_runners()
        engine.attach_context_graphs()
    engine.k_policy = _Alternating(k)
    drafter, proposer = engine.drafter, engine.proposer
    assert engine.kv_layout.draft_group  # the drafter's context kept within the window
    window = max(layer.sliding_window for layer in drafter.spec.layers)
    scratch = proposer.kv_cache.scratch_slot
    last_written = {}  # drafter cache slot -> the feature row last stored there
    writes = []  # (position, feature row) of every real row stored, in order
    combine, store = drafter.combine_hidden_states, drafter.precompute_and_store_context_kv
    seen_features = []

    def combine_spy(features):
        seen_features.append(features.clone())
        return combine(features)

    def store_spy(context, positions, slots, layers):
        features = seen_features.pop()
        for row, pos, slot in zip(features, positions.tolist(), slots.tolist()):
            if slot != scratch:
                last_written[slot] = row
                writes.append((pos, row))
        return store(context, positions, slots, layers)

    reads = []  # (prompt, anchor, the rows visible to the block at positions 0 .. anchor - 1)
    num_ahead = 0  # blocks queued ahead, at anchors known only on the device
    block_forward = proposer.runner.forward

    def block_spy(input_ids, items, *args, device_start=None, **kwargs):
        nonlocal num_ahead
        num_ahead += device_start is not None
        anchors = [it.start_pos for it in items]
        if device_start is not None:  # the items' starts are P + k + 1: k - a past the block
            max_shift = device_start.tokens.shape[1] - 1
            anchors = [p - max_shift + a for p, a in zip(anchors, device_start.accepted.tolist())]
        for it, anchor in zip(items, anchors):
            s = next(s for s in engine.scheduler.running if proposer.table(s) is it.block_table)
            first = max(0, anchor - window + 1)  # keys > anchor - window
            rows = [last_written.get(int(slot)) for slot in proposer.slots(s, first, anchor - first)]
            reads.append((tuple(s.prompt_token_ids), anchor, first, rows))
        return block_forward(input_ids, items, *args, device_start=device_start, **kwargs)

    drafter.combine_hidden_states, drafter.precompute_and_store_context_kv = combine_spy, store_spy
    proposer.runner.forward = block_spy
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outputs] == want
    # reference taps: one prefill over each final sequence, in a fresh engine
    ref = LLM(target, draft=draft, num_speculative_tokens=k, block_size=4, max_num_seqs=4).engine
    taps_of = {}
    for p, o in zip(prompts, outputs):
        tokens = p + o.token_ids
        blocks = ref.allocator.allocate(ref.allocator.blocks_needed(len(tokens), 0))
        _, taps = ref.runner.forward(tokens, [ForwardItem(len(tokens), 0, len(tokens), blocks)],
                                     ref.tap_layer_ids)
        ref.allocator.free(blocks)
        taps_of[tuple(p)] = taps
    num_checked = 0
    for prompt, anchor, first, rows in reads:
        for pos, row in enumerate(rows, start=first):
            assert row is not None, (prompt, anchor, pos)
            error = float((taps_of[prompt][pos] - row).abs().max())
            assert error < 1e-4, (prompt, anchor, pos, error)
            num_checked += 1
    assert len(reads) >= 3 * 3 and num_checked > len(reads) * min(window - 1, *map(len, prompts))
    # every stored row is some request's tap row of its position, except rejected drafts'
    def matches_some_request(pos, row):
        return any(pos < t.shape[0] and float((t[pos] - row).abs().max()) < 1e-4 for t in taps_of.values())

    num_rejected = sum(not matches_some_request(pos, row) for pos, row in writes)
    assert num_rejected > 0 if in_verify else num_rejected == 0
    # drafts ahead need the verify's store and the graph runner (here its eager padded path)
    assert num_ahead > 0 if in_verify and context_graphs else num_ahead == 0


@pytest.mark.parametrize("simulated", [None, 3.0])
def test_drafts_ahead_are_the_drafts_proposed_after_the_sync(pair, monkeypatch, simulated):
    """Each DFlash step queues the next step's drafter block from device values (anchor
    ``P + a + 1``, bonus ``t_a``) before its host sync. The drafts of every step equal those of
    an engine that proposes after the sync, at batch 1, 3 and 5 (padded batches, requests
    finishing at different steps), with real and with simulated acceptance (``a`` fixed at 2
    there, so an anchor off by one would change the drafts); the queued drafts are really used
    (most steps skip ``propose``), and the output is the target's."""
    from laguna_dflash.engine import engine as engine_module

    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=6,
              trace=True, simulate_acceptance_length=simulated)
    runs = []
    for ahead in (False, True):
        monkeypatch.setattr(engine_module, "draft_ahead", ahead)
        llm = LLM(target, **kw)
        engine = llm.engine
        engine.attach_graph_runners()  # CPU: the padded path the graphs replay, run eagerly
        calls = []
        propose = engine.proposer.propose
        engine.proposer.propose = (lambda seqs, k=None, calls=calls, propose=propose:
                                   (calls.append(1), propose(seqs, k))[1])
        out = []
        for batch_size in (1, 3, 5):
            prompts = _prompts(batch_size, seed=20 + batch_size)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params):
                out.append((o.token_ids, [step["draft_tokens"] for step in o.metrics["trace"]]))
        runs.append((out, len(calls), engine.timings.num_decode_steps))
    (want, proposed_before, steps_before), (got, proposed_ahead, steps_ahead) = runs
    assert got == want
    assert steps_ahead == steps_before and proposed_before == steps_before
    assert proposed_ahead < steps_ahead / 2, (proposed_ahead, steps_ahead)
    if simulated is None:
        base = LLM(target, block_size=4, max_num_seqs=6)
        for batch_size, start in ((1, 0), (3, 1), (5, 4)):
            prompts = _prompts(batch_size, seed=20 + batch_size)
            tokens = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
            assert tokens == [t for t, _ in got[start : start + batch_size]]


def test_drafts_ahead_survive_aborts_and_kv_pressure(pair):
    """With drafts queued ahead (graph runners' padded path on CPU): aborting a request between
    steps, and a KV cache small enough that requests are preempted and recomputed (the drafts
    ahead also grow block tables), leave the other requests' output equal to the target's."""
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = _prompts(5, seed=31)
    want = [o.token_ids for o in LLM(target, block_size=4, max_num_seqs=6)
            .generate(prompt_token_ids=prompts, sampling_params=params)]
    # abort: request 1 goes after a few speculative steps; the batch changes under the drafts ahead
    llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4, max_num_seqs=6)
    engine = llm.engine
    engine.attach_graph_runners()
    seqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine._ahead is not None
    engine.abort(seqs[1])
    while engine.has_unfinished:
        engine.step()
    assert [s.output_token_ids for i, s in enumerate(seqs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    # KV pressure: preemption and recompute with drafts ahead
    llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4, max_num_seqs=6,
              num_kv_blocks=24, max_model_len=64)
    engine = llm.engine
    engine.attach_graph_runners()
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))[1]
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert preempted, "no preemption: the test did not create KV pressure"
    assert got == want


@pytest.mark.parametrize("graphs", [True, False])
def test_forward_ahead_keeps_every_token(pair, monkeypatch, graphs):
    """``decode_ahead``: each target-only step queues the next step's forward with its sampled
    tokens (on the device) as input ids. Greedy and seeded sampled tokens equal those of an
    engine that runs each forward after the sync, at batch 1, 3 and 5 with requests ending at
    different steps (the next batch takes a subset of the rows), through the graph runner's
    padded path and eagerly; and most steps take the forward queued ahead."""
    from laguna_dflash.engine import engine as engine_module

    target, _ = pair
    runs = []
    for ahead in (False, True):
        monkeypatch.setattr(engine_module, "decode_ahead", ahead)
        llm = LLM(target, block_size=4, max_num_seqs=6)
        engine = llm.engine
        if graphs:
            engine.attach_graph_runners()
        fresh, queued = [], []
        forward = engine.runner.forward

        def spy(input_ids, *args, forward=forward, fresh=fresh, queued=queued, **kwargs):
            (queued if isinstance(input_ids, torch.Tensor) else fresh).append(len(args[0]))
            return forward(input_ids, *args, **kwargs)

        engine.runner.forward = spy
        run_staged = engine.runner.run_staged

        def staged_spy(staged, ids, *args, run_staged=run_staged, queued=queued, **kwargs):
            queued.append(len(staged.items))  # rows uploaded before the lm_head (stage_decode)
            return run_staged(staged, ids, *args, **kwargs)

        engine.runner.run_staged = staged_spy
        out = []
        for batch_size in (1, 3, 5):
            prompts = _prompts(batch_size, seed=40 + batch_size)
            params = [SamplingParams(temperature=0 if i % 2 == 0 else 0.8, top_p=0.9, seed=7 + i,
                                     max_tokens=6 + 5 * i, ignore_eos=True) for i in range(batch_size)]
            out += [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        runs.append((out, len(fresh), len(queued)))
    (want, fresh_before, queued_before), (got, fresh_ahead, queued_ahead) = runs
    assert got == want
    assert queued_before == 0
    assert queued_ahead > 2 * fresh_ahead, (fresh_ahead, queued_ahead)


@pytest.mark.parametrize("graphs", [True, False])
def test_forward_ahead_with_a_drafter_keeps_its_context(pair, monkeypatch, graphs):
    """With a drafter loaded, K = 0 steps queue the next target forward too, and the next K = 0
    step takes its hidden states and its taps (pending taps referencing the queued forward's
    rows). With K switching between 0 and 3 step by step, every speculative step's drafts (which
    read the drafter's context built from those taps) and every token equal those of an engine
    running each forward after the sync, at batch 1, 3 and 5 (requests ending at different
    steps: the next batch takes a subset of the rows); most K = 0 steps after a K = 0 step take
    the queued forward, and a queued forward a speculative step does not take changes nothing."""
    import itertools

    from laguna_dflash.engine import engine as engine_module

    target, draft = pair
    schedule = [0, 0, 0, 3, 0, 0, 3, 3, 0, 0, 0, 0, 0, 3]  # K of each step, cycled
    runs = []
    for ahead in (False, True):
        monkeypatch.setattr(engine_module, "decode_ahead", ahead)
        llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4, max_num_seqs=6,
                  trace=True)
        engine = llm.engine
        if graphs:
            engine.attach_graph_runners()
        taken = []
        decode, step, counter = engine._decode, engine.step, itertools.count()

        def spy(seqs, ahead=None, decode=decode, taken=taken):
            taken.append(ahead is not None and ahead.taps is not None and ahead.rows_for(seqs) is not None)
            return decode(seqs, ahead)

        def stepper(engine=engine, step=step, counter=counter):
            engine.num_speculative_tokens = schedule[next(counter) % len(schedule)]
            return step()

        engine._decode, engine.step = spy, stepper
        out = []
        for batch_size in (1, 3, 5):
            prompts = _prompts(batch_size, seed=50 + batch_size)
            params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True)
                      for i in range(batch_size)]
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params):
                out.append((o.token_ids, [st["draft_tokens"] for st in o.metrics["trace"]]))
        runs.append((out, taken))
    (want, taken_before), (got, taken_ahead) = runs
    assert got == want
    assert any(len(drafts) for _, drafts in got)  # speculative steps really drafted
    assert not any(taken_before)
    assert sum(taken_ahead) > len(taken_ahead) / 3, (sum(taken_ahead), len(taken_ahead))


def test_forward_ahead_under_the_adaptive_k_policy(pair):
    """The real adaptive-K policy with a drafter whose drafts are rarely accepted settles on
    K = 0 and, through ``AdaptiveK.expects_target_only``, queues forwards ahead on its K = 0
    steps (graph runners' padded path on CPU): the output equals the target's, and forwards
    queued ahead are taken."""
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(3, seed=61)
    want = [o.token_ids for o in LLM(target, block_size=4, max_num_seqs=4)
            .generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, adaptive_k=True,
              block_size=4, max_num_seqs=4)
    engine = llm.engine
    engine.attach_graph_runners()
    taken, decode = [], engine._decode
    engine._decode = lambda seqs, ahead=None: (
        taken.append(ahead is not None and ahead.rows_for(seqs) is not None), decode(seqs, ahead))[1]
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    assert sum(taken) > len(taken) / 2, (sum(taken), len(taken))


def test_bench_phase_clock_unwraps_on_exit(pair, monkeypatch):
    """benchmarks/bench_gpu_xs.py's PhaseClock syncs around the graph forwards and the context
    store: inside ``with`` it records them, and on exit the engine's own methods are back, so
    step times taken outside it do not pay syncs that undo the work queued ahead of each step's
    host sync (the seventh pass's invalid end-to-end run)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gpu_xs

    from laguna_dflash.engine import engine as engine_module

    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4, max_num_seqs=4)
    engine = llm.engine
    engine.attach_graph_runners()
    owners = (engine.proposer, engine.runner.graphs, engine.proposer.runner.graphs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with bench_gpu_xs.PhaseClock(llm, device="cpu") as clock:
        assert all(vars(o).keys() & {"store_context", "forward"} for o in owners)
        # prompts of 9 and 17 tokens: their context stores have more than K_max + 1 = 4 rows
        llm.generate(prompt_token_ids=_prompts(4, seed=3)[2:], sampling_params=params)
        assert clock.times["target forward"] and clock.times["drafter block"]
        # the prompts' context store is recorded apart; the verify graph stores each step's
        # context, so there is no per-step store to time (the column prints "-")
        assert clock.times["prompt context"] and clock.median_ms("context precompute") is None
    assert not any(vars(o).keys() & {"store_context", "forward"} for o in owners)
    with bench_gpu_xs.PhaseClock(llm, device="cpu") as clock:  # each step's store apart
        monkeypatch.setattr(engine_module, "store_context_in_verify", False)
        llm.generate(prompt_token_ids=_prompts(4, seed=4)[2:], sampling_params=params)
        assert clock.median_ms("context precompute") is not None and clock.times["prompt context"]


def test_forward_ahead_survives_aborts_and_kv_pressure(pair, monkeypatch):
    """With target forwards queued ahead: an abort between steps, and a KV cache small enough
    that requests are preempted and recomputed, leave the other requests' tokens unchanged."""
    from laguna_dflash.engine import engine as engine_module

    target, _ = pair
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = _prompts(5, seed=33)
    want = [o.token_ids for o in LLM(target, block_size=4, max_num_seqs=6)
            .generate(prompt_token_ids=prompts, sampling_params=params)]
    monkeypatch.setattr(engine_module, "decode_ahead", True)
    engine = LLM(target, block_size=4, max_num_seqs=6).engine
    engine.attach_graph_runners()
    seqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert isinstance(engine._ahead, engine_module.ForwardAhead)
    engine.abort(seqs[1])
    while engine.has_unfinished:
        engine.step()
    assert [s.output_token_ids for i, s in enumerate(seqs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    llm = LLM(target, block_size=4, max_num_seqs=6, num_kv_blocks=18, max_model_len=64)
    preempted = []
    preempt = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))[1]
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert preempted, "no preemption: the test did not create KV pressure"
    assert got == want


def test_prefill_stores_the_prompts_context(pair):
    """The prefill step writes the drafter's context K/V of every prompt position (no pending
    taps survive it: the decode steps never carry a prompt-sized store), and only those slots
    (of the blocks not the target's: the drafter's layers are pool entries of the hybrid
    layout, whose other groups' blocks the target's layers write)."""
    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=BLOCK_SIZE - 1, block_size=4, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in _prompts(3, seed=5)]
    layers = engine.proposer.kv_cache.layers
    before = [tuple(t.clone() for t in layer) for layer in layers]
    engine.step()  # the prefill of all three prompts
    assert all(s.num_computed == len(s.prompt_token_ids) for s in seqs)
    assert all(s.num_pending == 0 for s in seqs)
    written = {int(slot) for s in seqs
               for slot in engine.proposer.slots(s, 0, len(s.prompt_token_ids))}
    draft_group, bs = engine.kv_layout.draft_group, 4
    assert draft_group and len(written) == sum(len(s.prompt_token_ids) for s in seqs)
    targets = {b * bs + j for s in seqs for g, table in enumerate([s.block_table, *s.swa_block_tables])
               if g != draft_group for b in table for j in range(bs)}
    assert not targets & written
    for layer, old in zip(layers, before):
        for new_t, old_t in zip(layer, old):  # K and V caches [slots, heads, head_dim]
            changed = {int(i) for i in (new_t != old_t).flatten(1).any(1).nonzero().flatten()}
            assert changed - targets == written
