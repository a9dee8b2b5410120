"""``kernels/rewind_rows.py``: a drafter block queued ahead gets its first positions and first
token ids on the device in one launch, bitwise the torch ops (``rewind_rows_reference``), under
Triton's CPU interpreter (child process) and on CUDA; the graph runner takes it."""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

from laguna_dflash.kernels.rewind_rows import rewind_rows, rewind_rows_reference

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")


def _inputs(r: int, max_shift: int, seed: int, device: str = "cpu", accepted_dtype=torch.int64):
    """Request rows as the graph runner uploads them for a block queued ahead (start ``P + S +
    1``, ``seq_len = start + q``, placeholder id 0 then mask ids), a row stride past the width
    and two rows past ``R`` (padding: untouched); accepted drafts ``0..S``; target tokens."""
    gen = torch.Generator().manual_seed(seed)
    q, ids_col = max_shift + 1, 6
    width = ids_col + q
    state = torch.randint(0, 10_000, (r + 2, width + 3), generator=gen)[:, :width]
    starts = torch.randint(max_shift + 1, 5000, (r + 2,), generator=gen)
    state[:, 0], state[:, 1] = starts, starts + q
    state[:, ids_col] = 0
    state[:, ids_col + 1 :] = 99
    accepted = torch.randint(0, max_shift + 1, (r,), generator=gen).to(accepted_dtype)
    tokens = torch.randint(100, 200_000, (r, max_shift + 1), generator=gen)
    return state.to(device), accepted.to(device), tokens.to(device), ids_col


def _assert_same(state, accepted, tokens, ids_col) -> None:
    got, want = state.clone(), state.clone()
    rewind_rows(got, accepted, tokens, ids_col)
    rewind_rows_reference(want, accepted, tokens, ids_col)
    assert torch.equal(got, want)


def test_reference_moves_each_row_back_and_takes_the_accepted_token() -> None:
    state, accepted, tokens, ids_col = _inputs(3, 3, seed=0)
    before = state.clone()
    rewind_rows_reference(state, accepted, tokens, ids_col)
    for i in range(3):
        shift = 3 - int(accepted[i])
        assert state[i, 0] == before[i, 0] - shift and state[i, 1] == before[i, 1] - shift
        assert state[i, ids_col] == tokens[i, int(accepted[i])]
    assert torch.equal(state[:, 2:ids_col], before[:, 2:ids_col])  # block tables
    assert torch.equal(state[:, ids_col + 1 :], before[:, ids_col + 1 :])  # mask ids
    assert torch.equal(state[3:], before[3:])  # rows past R


@interpreted
@pytest.mark.parametrize("r,max_shift", [(1, 3), (3, 1), (5, 7), (2, 15)])
def test_interpreted_equals_the_torch_ops(r, max_shift) -> None:
    for seed in range(3):
        _assert_same(*_inputs(r, max_shift, seed))
    _assert_same(*_inputs(r, max_shift, 9, accepted_dtype=torch.int32))


@interpreted
def test_interpreted_graph_runner_takes_the_kernel(monkeypatch) -> None:
    """``CUDAGraphRunner.forward`` with a ``DeviceStart`` (its padded path on the CPU) launches the
    kernel once where Triton runs, and the model sees the rewound rows: positions ``P + a + 1..``
    and first token ``t_a``, the same as the torch path gives."""
    from laguna_dflash.engine import cuda_graph
    from laguna_dflash.engine.kv_cache import KVCache
    from laguna_dflash.engine.runner import ForwardItem
    from laguna_dflash.kernels import rewind_rows as module

    kv = KVCache(1, 40, 4, 1, 8, torch.float32, "cpu")
    runner = cuda_graph.CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=8,
                                        max_model_len=100, max_tokens_per_request=4)
    seen = []
    monkeypatch.setattr(runner, "_run_model", lambda r, q, *a: seen.append(runner.state[:r].clone())
                        or (torch.zeros(r * q, 2), None))
    calls = []
    launch = module._kernel
    monkeypatch.setattr(module, "_kernel", lambda mode: calls.append(mode) or launch(mode))
    items = [ForwardItem(4, 14, 18, [5, 2, 9, 7, 1]), ForwardItem(4, 7, 11, [3, 4, 6])]  # P + 4
    start = cuda_graph.DeviceStart(torch.tensor([1, 3]), torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]]))
    for use_kernel in (True, False):
        monkeypatch.setattr(module, "USE_KERNEL", use_kernel)
        runner.forward([0, 7, 7, 7] * 2, items, (), True, device_start=start)
    assert len(calls) == 1
    got, want = seen
    assert torch.equal(got, want)
    off = runner.ids_offset
    assert got[:2, :2].tolist() == [[12, 16], [7, 11]]
    assert got[:2, off : off + 4].tolist() == [[12, 7, 7, 7], [24, 7, 7, 7]]


def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__)


def test_bad_arguments_name_the_fix() -> None:
    state, accepted, tokens, ids_col = _inputs(2, 3, seed=0)
    with pytest.raises(ValueError, match="int64"):
        rewind_rows_reference(state.int(), accepted, tokens, ids_col)
    with pytest.raises(ValueError, match="accepted must be"):
        rewind_rows_reference(state, accepted.float(), tokens, ids_col)
    with pytest.raises(ValueError, match="tokens must be"):
        rewind_rows_reference(state, accepted, tokens[:1], ids_col)
    with pytest.raises(ValueError, match="ids_col"):
        rewind_rows_reference(state, accepted, tokens, state.shape[1])


@cuda
@pytest.mark.parametrize("r,max_shift", [(1, 3), (16, 7), (64, 15)])
def test_cuda_equals_the_torch_ops(r, max_shift) -> None:
    for seed in range(2):
        _assert_same(*_inputs(r, max_shift, seed, device="cuda"))
    _assert_same(*_inputs(r, max_shift, 5, device="cuda", accepted_dtype=torch.int32))
