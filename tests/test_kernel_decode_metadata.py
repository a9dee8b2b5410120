"""``kernels/decode_metadata.py``: the graphed forward's attention metadata in one launch,
bitwise the torch ops it replaces (``decode_metadata_reference``), under Triton's CPU interpreter
(child process) and on CUDA."""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

from laguna_dflash.kernels.decode_metadata import decode_metadata, decode_metadata_reference

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
    from laguna_dflash.engine.kv_cache import KVCache
    from laguna_dflash.kernels import decode_metadata as module

    kv = KVCache(1, 40, 4, 1, 8, torch.float32, "cpu")
    runner = cuda_graph.CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=8,
                                        max_model_len=100, max_tokens_per_request=3)
    runner.start_pos[:4] = torch.tensor([10, 0, 4, 0])
    runner.seq_lens[:4] = torch.tensor([13, 3, 7, 3])
    runner.block_tables[:4] = runner.scratch_block
    for i, table in enumerate(([5, 2, 9, 7], [1], [3, 4])):
        runner.block_tables[i, : len(table)] = torch.tensor(table)
    calls = []
    launch = module.decode_metadata
    monkeypatch.setattr(module, "decode_metadata", lambda *a: calls.append(a[1:]) or launch(*a))
    got, = runner._metadata(4, 3, runner.key_bucket(13), is_causal=True)  # one table: no hybrid layout
    monkeypatch.setattr(cuda_graph, "use_metadata_kernel", False)
    want, = runner._metadata(4, 3, runner.key_bucket(13), is_causal=True)
    assert len(calls) == 1
    for name in ("positions", "slot_mapping", "flat_index", "query_index", "query_positions",
                 "key_slots", "seq_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


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
