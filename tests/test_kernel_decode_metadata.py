"""``kernels/decode_metadata.py``: the graphed forward's attention metadata in one launch,
bitwise the torch ops it replaces (``decode_metadata_reference``), under Triton's CPU interpreter
(child process) and on CUDA."""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

from laguna_dflash.kernels.decode_metadata import (
    decode_metadata,
    decode_metadata_reference,
    decode_metadata_tables,
    decode_metadata_tables_reference,
)

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")


def _state(r: int, q: int, num_keys: int, bs: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, int]:
    """``[R, W]`` request rows as the graph runner fills them: real requests with random block
    tables, first positions and ``seq_len = start + q``, the last row a padding request (scratch
    block, positions 0..q-1); extra columns after the table (token ids) and a row stride > W."""
    gen = torch.Generator().manual_seed(seed)
    nb = num_keys // bs
    num_blocks = max(96, nb)  # the cache's blocks; the scratch block comes after them
    scratch_block = num_blocks + 1
    width = 2 + nb + q
    state = torch.zeros(r, width + 3, dtype=torch.long)[:, :width]  # row stride > width
    for i in range(r):
        if i == r - 1 and r > 1:  # padding request
            state[i, 0], state[i, 1] = 0, q
            state[i, 2 : 2 + nb] = scratch_block
            continue
        seq_len = int(torch.randint(q, num_keys + 1, (1,), generator=gen))
        state[i, 0], state[i, 1] = seq_len - q, seq_len
        state[i, 2 : 2 + nb] = torch.randperm(num_blocks, generator=gen)[:nb]
        state[i, 2 + nb :] = torch.randint(0, 1000, (q,), generator=gen)  # token ids
    return state.to(device), scratch_block * bs


def _tables_state(r: int, q: int, num_keys: int, bs: int, num_tables: int, seed: int, device: str = "cpu"
                  ) -> tuple[torch.Tensor, int, int]:
    """``_state``'s rows with ``num_tables`` block tables ``stride`` columns apart (the graph
    runner's hybrid layout: a table a KV group), each table its own blocks; returns the state,
    the scratch slot and the stride."""
    nb = num_keys // bs
    stride = nb + 3  # a gap of unused columns between the tables
    one, scratch = _state(r, q, num_keys, bs, seed)
    state = torch.zeros(r, 2 + num_tables * stride + q + 2, dtype=torch.long)
    state[:, :2] = one[:, :2]
    for t in range(num_tables):
        # another table of the same requests: block ids shifted (the padding row's scratch block kept)
        table = one[:, 2 : 2 + nb].clone()
        real = slice(0, r - 1) if r > 1 else slice(0, 1)  # _state's last row pads when r > 1
        table[real] = (table[real] + 7 * t) % (scratch // bs)
        state[:, 2 + t * stride : 2 + t * stride + nb] = table
        state[:, 2 + t * stride + nb : 2 + (t + 1) * stride] = -1  # the gap: never read
    state[:, 2 + num_tables * stride : 2 + num_tables * stride + q] = one[:, 2 + nb :]
    return state.to(device), scratch, stride


def _assert_tables_same(state, q, num_keys, bs, scratch, num_tables, stride) -> None:
    """One launch for every table equals the torch reference and, table by table, the one-table
    kernel at that table's columns."""
    got = decode_metadata_tables(state, q, num_keys, bs, scratch, num_tables, 2, stride)
    want = decode_metadata_tables_reference(state, q, num_keys, bs, scratch, num_tables, 2, stride)
    for name, g, w in zip(("q_pos", "slots", "key_slots", "seq_lens"), got, want):
        assert g.dtype == torch.int64 and g.is_contiguous(), name
        assert torch.equal(g, w), name
    for t in range(num_tables):
        q_pos, slots, key_slots, seq_lens = decode_metadata(state, q, num_keys, bs, scratch, 2 + t * stride)
        assert torch.equal(got[0], q_pos) and torch.equal(got[3], seq_lens)
        assert torch.equal(got[1][t], slots) and torch.equal(got[2][t], key_slots), t
    if num_tables > 1:  # the tables really differ, so a wrong table offset would show
        assert not torch.equal(got[2][0], got[2][1])


def _assert_same(state, q, num_keys, bs, scratch) -> None:
    got = decode_metadata(state, q, num_keys, bs, scratch)
    want = decode_metadata_reference(state, q, num_keys, bs, scratch)
    for name, g, w in zip(("q_pos", "slots", "key_slots", "seq_lens"), got, want):
        assert g.dtype == torch.int64 and g.is_contiguous(), name
        assert torch.equal(g, w), name


@interpreted
@pytest.mark.parametrize("r,q,num_keys,bs", [
    (1, 1, 256, 16),    # batch-1 decode
    (3, 4, 512, 16),    # verify of K = 3, a padding row
    (2, 16, 2048, 64),  # drafter block of 16, two key chunks of the kernel
    (5, 3, 64, 4),      # q not a power of two, small blocks
    (4, 4, 2048, 16),   # 128 blocks a table (more than the default 96 of the cache)
])
def test_interpreted_equals_the_torch_ops(r, q, num_keys, bs) -> None:
    for seed in range(3):
        state, scratch = _state(r, q, num_keys, bs, seed)
        _assert_same(state, q, num_keys, bs, scratch)


@interpreted
@pytest.mark.parametrize("r,q,num_keys,bs,num_tables", [
    (1, 1, 256, 16, 4),     # batch-1 decode, XS-2.1's hybrid layout (full + 3 sliding groups)
    (3, 4, 512, 16, 2),     # verify of K = 3, a padding row
    (2, 16, 2048, 64, 3),   # two key chunks a table
    (4, 3, 64, 4, 1),       # one table through the tables entry point
])
def test_interpreted_tables_in_one_launch(r, q, num_keys, bs, num_tables) -> None:
    for seed in range(2):
        state, scratch, stride = _tables_state(r, q, num_keys, bs, num_tables, seed)
        _assert_tables_same(state, q, num_keys, bs, scratch, num_tables, stride)


@interpreted
def test_interpreted_masks_keys_at_and_past_seq_len() -> None:
    state, scratch = _state(1, 2, 256, 16, seed=0)
    state[0, 0], state[0, 1] = 38, 40  # keys 40.. go to the scratch slot
    q_pos, slots, key_slots, seq_lens = decode_metadata(state, 2, 256, 16, scratch)
    assert q_pos.tolist() == [[38, 39]] and seq_lens.tolist() == [40]
    assert (key_slots[0, 40:] == scratch).all() and not (key_slots[0, :40] == scratch).any()
    assert slots[0, 1] == state[0, 2 + 39 // 16] * 16 + 39 % 16


@interpreted
def test_interpreted_graph_runner_takes_the_kernel(monkeypatch) -> None:
    """``CUDAGraphRunner._metadata`` (its padded path on the CPU) launches the kernel where Triton
    runs, and gives the metadata of its torch path, padding request included."""
    from laguna_dflash.engine import cuda_graph
    from laguna_dflash.engine.kv_cache import HybridLayout, KVCache
    from laguna_dflash.kernels import decode_metadata as module

    launch = module.decode_metadata_tables

    for layout in (None, HybridLayout.for_layers([None, 4, 4, None, 4, 4])):  # one table; 1 full + 2 sliding
        kv = KVCache(6, 40, 4, 1, 8, torch.float32, "cpu", layout)
        runner = cuda_graph.CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=8,
                                            max_model_len=100, max_tokens_per_request=3)
        runner.start_pos[:4] = torch.tensor([10, 0, 4, 0])
        runner.seq_lens[:4] = torch.tensor([13, 3, 7, 3])
        for t in range(runner.num_tables):  # every table its own blocks
            col = 2 + t * runner.max_blocks
            runner.state[:4, col : col + runner.max_blocks] = runner.scratch_block
            for i, table in enumerate(([5, 2, 9, 7], [1], [3, 4])):
                runner.state[i, col : col + len(table)] = torch.tensor(table) + 10 * t
        calls = []

        def counted(*args, calls=calls):
            calls.append(args[1:])
            return launch(*args)

        monkeypatch.setattr(module, "decode_metadata_tables", counted)
        got = runner._metadata(4, 3, runner.key_bucket(13), is_causal=True)
        monkeypatch.setattr(cuda_graph, "use_metadata_kernel", False)
        want = runner._metadata(4, 3, runner.key_bucket(13), is_causal=True)
        monkeypatch.undo()
        assert len(calls) == 1, calls  # one launch for every table
        assert len(got) == len(want) == (1 if layout is None else 3)
        for g, w in zip(got, want):
            for name in ("positions", "slot_mapping", "flat_index", "query_index", "query_positions",
                         "key_slots", "seq_lens"):
                assert torch.equal(getattr(g, name), getattr(w, name)), name
        if layout is not None:  # each table's slots are its own
            assert not torch.equal(got[0].key_slots, got[1].key_slots)


def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__)


def test_bad_arguments_name_the_fix() -> None:
    state, scratch = _state(2, 1, 256, 16, seed=0)
    with pytest.raises(ValueError, match="multiple of block_size"):
        decode_metadata_reference(state, 1, 250, 16, scratch)
    with pytest.raises(ValueError, match="int64"):
        decode_metadata_reference(state.int(), 1, 256, 16, scratch)
    with pytest.raises(ValueError, match="does not fit"):
        decode_metadata_reference(state[:, :10], 1, 256, 16, scratch)
    with pytest.raises(ValueError, match="table_stride"):  # 16 blocks a table, 8 columns apart
        decode_metadata_tables_reference(state, 1, 256, 16, scratch, 2, 2, 8)
    with pytest.raises(ValueError, match="2 tables 16 columns apart"):  # the state holds one table
        decode_metadata_tables_reference(state, 1, 256, 16, scratch, 2, 2, 16)


@cuda
@pytest.mark.parametrize("r,q,num_keys,bs,num_tables", [(1, 1, 1024, 16, 4), (4, 4, 2048, 16, 4), (16, 8, 4096, 64, 2)])
def test_cuda_tables_in_one_launch(r, q, num_keys, bs, num_tables) -> None:
    state, scratch, stride = _tables_state(r, q, num_keys, bs, num_tables, seed=3, device="cuda")
    _assert_tables_same(state, q, num_keys, bs, scratch, num_tables, stride)


@cuda
@pytest.mark.parametrize("r,q,num_keys,bs", [(1, 1, 1024, 16), (4, 4, 2048, 16), (16, 8, 4096, 64)])
def test_cuda_equals_the_torch_ops_in_a_graph(r, q, num_keys, bs) -> None:
    state, scratch = _state(r, q, num_keys, bs, seed=1, device="cuda")
    _assert_same(state, q, num_keys, bs, scratch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = decode_metadata(state, q, num_keys, bs, scratch)
    state.copy_(_state(r, q, num_keys, bs, seed=2, device="cuda")[0])
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(outs, decode_metadata_reference(state, q, num_keys, bs, scratch)):
        assert torch.equal(g, w)
