"""``kernels/accept_pack.py``: a DFlash step's accepted-draft counts and its host copy's rows
``[a, t_0..t_K, d_1..d_K]`` in one launch, bitwise the torch ops (``accept_and_pack_reference``,
which is ``spec_decode.num_accepted`` plus a cat), under Triton's CPU interpreter (child process)
and on CUDA; the engine's DFlash step takes it."""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

from laguna_dflash.engine.spec_decode import num_accepted
from laguna_dflash.kernels.accept_pack import accept_and_pack, accept_and_pack_reference

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")


def _inputs(r: int, k: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts ``[R, K]`` and target tokens ``[R, K+1]`` (int64, a row stride past the width, as
    views of wider buffers) whose rows cover every acceptance: row ``i`` matches its first
    ``i % (K+1)`` drafts and then differs at that draft (row 0: none matches; row K: all
    match), and its drafts past the first mismatch match again at random (a count of the
    matches is not the prefix)."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(100, 200_000, (r, k + 4), generator=gen)[:, : k + 1]
    drafts = torch.randint(100, 200_000, (r, k + 3), generator=gen)[:, :k]
    for i in range(r):
        a = i % (k + 1)
        drafts[i, :a] = targets[i, :a]
        if a < k:
            drafts[i, a] = targets[i, a] + 1
            again = torch.rand(k, generator=gen) < 0.7
            again[: a + 1] = False
            drafts[i, again] = targets[i, :k][again]
    return drafts.to(device), targets.to(device)


def _assert_same(drafts: torch.Tensor, targets: torch.Tensor, accepted: torch.Tensor | None = None) -> None:
    got_packed, got_accepted = accept_and_pack(drafts, targets, accepted)
    want_packed, want_accepted = accept_and_pack_reference(drafts, targets, accepted)
    for got, want in ((got_packed, want_packed), (got_accepted, want_accepted)):
        assert got.dtype == torch.int64 and got.is_contiguous()
        assert torch.equal(got, want), (got, want)


def test_reference_packs_the_count_the_targets_and_the_drafts() -> None:
    k = 3
    drafts, targets = _inputs(5, k, seed=0)
    packed, accepted = accept_and_pack_reference(drafts, targets)
    assert packed.shape == (5, 2 * k + 2) and accepted.shape == (5,)
    assert accepted.tolist() == [0, 1, 2, 3, 0]
    assert torch.equal(accepted, num_accepted(drafts, targets).to(torch.int64))
    assert torch.equal(packed[:, 0], accepted)
    assert torch.equal(packed[:, 1 : k + 2], targets) and torch.equal(packed[:, k + 2 :], drafts)
    # explicit values: drafts 11 22 33 against targets 11 22 99 7 -> two accepted
    packed, accepted = accept_and_pack_reference(torch.tensor([[11, 22, 33]]), torch.tensor([[11, 22, 99, 7]]))
    assert packed.tolist() == [[2, 11, 22, 99, 7, 11, 22, 33]] and accepted.tolist() == [2]
    # given counts are copied, not recomputed; the returned counts are not a view of packed
    given = torch.tensor([3, 0, 1, 2, 3], dtype=torch.int32)
    packed, accepted = accept_and_pack_reference(drafts, targets, given)
    assert packed[:, 0].tolist() == accepted.tolist() == given.tolist()
    accepted[0] = -1
    assert packed[0, 0] == 3


def test_empty_batch_returns_empty_rows() -> None:
    packed, accepted = accept_and_pack(torch.empty(0, 4, dtype=torch.int64), torch.empty(0, 5, dtype=torch.int64))
    assert packed.shape == (0, 10) and accepted.shape == (0,) and packed.dtype == accepted.dtype == torch.int64


@interpreted
@pytest.mark.parametrize("r,k", [(1, 1), (3, 1), (1, 15), (5, 7), (20, 15), (64, 3), (64, 15)])
def test_interpreted_equals_the_torch_ops(r, k) -> None:
    for seed in range(2):
        drafts, targets = _inputs(r, k, seed)
        _assert_same(drafts, targets)
        _assert_same(drafts.contiguous(), targets.contiguous())
    gen = torch.Generator().manual_seed(7)
    given = torch.randint(0, k + 1, (r,), generator=gen)
    _assert_same(drafts, targets, given)
    _assert_same(drafts, targets, given.to(torch.int32))


@interpreted
def test_interpreted_extremes_and_strided_inputs() -> None:
    """Every draft matching (``a = K``), none matching (``a = 0``), the first mismatch in the
    middle with the drafts after it matching; column-strided inputs (a transposed buffer)."""
    k = 15
    targets = torch.arange(4 * (k + 1)).view(4, k + 1) + 1000
    drafts = targets[:, :k].clone()
    drafts[1, 0] = -1  # none
    drafts[2, 7] = -1  # the middle: 7, though 14 of 15 match
    drafts[3, k - 1] = -1  # all but the last
    packed, accepted = accept_and_pack(drafts, targets)
    assert accepted.tolist() == [k, 0, 7, k - 1]
    assert torch.equal(packed[:, 1 : k + 2], targets) and torch.equal(packed[:, k + 2 :], drafts)
    _assert_same(drafts, targets)
    _assert_same(drafts.t().contiguous().t(), targets.t().contiguous().t())


@interpreted
def test_interpreted_engine_takes_the_kernel(monkeypatch) -> None:
    """A DFlash step launches the kernel once where Triton runs (the CPU under the interpreter)."""
    from laguna_dflash.engine import engine as engine_module
    from laguna_dflash.kernels import accept_pack as module

    calls = []
    launch = module._kernel
    monkeypatch.setattr(module, "_kernel", lambda mode: calls.append(mode) or launch(mode))
    drafts, targets = _inputs(3, 4, seed=1)
    packed, accepted = engine_module.accept_and_pack(drafts, targets)
    assert len(calls) == 1
    assert accepted.tolist() == [0, 1, 2]
    monkeypatch.setattr(module, "USE_KERNEL", False)
    engine_module.accept_and_pack(drafts, targets)
    assert len(calls) == 1
    monkeypatch.setattr(module, "USE_KERNEL", True)
    packed, accepted = accept_and_pack(drafts[:0], targets[:0])  # no rows: nothing to launch
    assert len(calls) == 1 and packed.shape == (0, 10) and accepted.shape == (0,)


@pytest.mark.parametrize("simulated", [None, 3.0])
def test_dflash_step_commits_what_it_packs(tmp_path, monkeypatch, simulated) -> None:
    """The engine's DFlash step packs through ``accept_and_pack`` (the CPU path here) once a
    step, with the simulated counts when acceptance is simulated, and commits what it packed:
    each traced step's drafts and accepted count are its packed row's."""
    import dflash_fixtures as df

    from laguna_dflash import LLM, SamplingParams
    from laguna_dflash.engine import engine as engine_module

    target, draft = df.make_laguna_poolside_pair(tmp_path, block_size=4)
    packs = []

    def spy(drafts, targets, accepted=None):
        packed, counts = accept_and_pack(drafts, targets, accepted)
        packs.append((accepted, packed, counts))
        return packed, counts

    monkeypatch.setattr(engine_module, "accept_and_pack", spy)
    llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4, max_num_seqs=2, trace=True,
              simulate_acceptance_length=simulated)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[[3, 1, 4, 1, 5]], sampling_params=params)
    trace = out.metrics["trace"]
    assert len(packs) == len(trace) > 1
    for (given, packed, accepted), step in zip(packs, trace):
        assert (given is None) == (simulated is None)
        assert packed.shape == (1, 8) and accepted.tolist() == [step["num_accepted"]]
        assert packed[0, 5:].tolist() == step["draft_tokens"]
        if given is not None:
            assert accepted.tolist() == given.tolist()


def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__)


def test_bad_arguments_name_the_fix() -> None:
    drafts, targets = _inputs(2, 3, seed=0)
    with pytest.raises(ValueError, match="drafts must be"):
        accept_and_pack(drafts.int(), targets)
    with pytest.raises(ValueError, match="K >= 1"):
        accept_and_pack(drafts[:, :0], targets[:, :1])
    with pytest.raises(ValueError, match=r"target_tokens must be \[R, K \+ 1\]"):
        accept_and_pack(drafts, targets[:, :3])
    with pytest.raises(ValueError, match="target_tokens must be"):
        accept_and_pack_reference(drafts, targets.int())
    with pytest.raises(ValueError, match="accepted must be"):
        accept_and_pack(drafts, targets, torch.zeros(2))
    with pytest.raises(ValueError, match="accepted must be"):
        accept_and_pack_reference(drafts, targets, torch.zeros(3, dtype=torch.int64))


@cuda
@pytest.mark.parametrize("r,k", [(1, 1), (1, 15), (16, 7), (64, 15)])
def test_cuda_equals_the_torch_ops(r, k) -> None:
    for seed in range(2):
        drafts, targets = _inputs(r, k, seed, device="cuda")
        _assert_same(drafts, targets)
    given = torch.randint(0, k + 1, (r,), device="cuda")
    _assert_same(drafts, targets, given)
    _assert_same(drafts, targets, given.to(torch.int32))
    _assert_same(drafts.t().contiguous().t(), targets.t().contiguous().t())
