"""Fused MoE experts (kernels/fused_moe.py): torch reference, Triton kernel, MoE.forward hook.

* ``moe_experts_reference`` equals ``MoE.experts_forward`` bit for bit (fp32 and bf16).
* On the CPU, ``MoE.forward`` never takes the fused path (bit-identical with it switched off).
* The Triton kernels equal the reference under ``TRITON_INTERPRET=1`` on the CPU: T in {1, 3, 16},
  top_k in {1, 2, 8}, E in {4, 64}, fp32 and bf16, plus shapes with several column blocks and
  K-loop steps and a run longer than one row tile (every token on the same experts). The
  interpreter runs in ONE subprocess (the variable must be set before triton is imported and must
  not leak into other tests); each case is reported as its own test.
* On CUDA (skipped without one): Laguna-XS-2.1 shapes (H 2048, I 512, E 256, k 8) vs the
  reference, ``MoE.forward`` fused vs torch, and CUDA-graph capture.
* Skipped pairs (``has_skipped_pairs``: id ``-1``, an expert on another rank under expert
  parallelism), with :func:`ep_problem` / :func:`check_skipped_pairs` (shared with the GEMV and
  the sorted kernels' tests): the reference drops them; under the interpreter (a child pytest,
  ``-k interpreted``) and on CUDA (with a CUDA-graph capture) a rank's call gives its pairs the
  global call's bits and the skipped pairs exact zeros, with NaN wherever a read of a skipped
  pair's weights would land; none skipped with the flag on equals the flag off.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from interpreter_child import (
    INTERPRETED,
    interpreted,
    interpreter_script_json,
    run_interpreted_child,
)
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels.fused_moe import (
    HAS_TRITON,
    fused_moe_experts,
    is_available,
    moe_experts_reference,
)
from laguna_dflash.models.layers import MoE

# relative tolerances on max|ours - ref| / max|ref| against an fp32 reference
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _problem(
    t: int, k: int, e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
    same_experts: bool = False, device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """x [T, H], ids [T, k] (distinct per token), weights [T, k], gate_up [E, 2I, H], down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    if same_experts:
        ids = torch.arange(k).repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    return tuple(
        a.to(device=device, dtype=dtype if a.is_floating_point() else a.dtype)
        for a in (x, ids, weights, gate_up, down)
    )


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def routed_experts(ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same routing over only the experts it hits: ``(local_ids, gate_up[used], down[used])``.

    ``ids [T, k]`` (no ``-1``) map to their rank in the sorted unique ids, so every pair reads
    the same weights and the experts keep their order (the reference visits pairs in expert
    order). At S-2.1 size an fp32 copy of all 257 experts is 9.7 GB, of the 11 or 44 routed at
    1 or 4 tokens 0.4 or 1.7 GB: the whole stack widened per test ran 12 pytest workers out of
    an 80 GB card. Routing that hits every expert gets the stacks back as they are (no copy).
    """
    assert bool((ids >= 0).all()), "routed_experts takes no skipped (-1) pairs"
    used, local = torch.unique(ids, sorted=True, return_inverse=True)
    if used.numel() == gate_up.shape[0]:
        return ids, gate_up, down
    return local.view_as(ids), gate_up[used], down[used]


def fp32_reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    local, gate_up, down = routed_experts(ids, gate_up, down)
    return moe_experts_reference(x.float(), local, weights.float(), gate_up.float(), down.float())


def ep_problem(
    t: int, k: int, e_total: int, lo: int, hi: int, hidden: int, inter: int, dtype: torch.dtype,
    seed: int, device: str = "cpu",
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
    """One rank's view under expert parallelism: ``(full, rank, skipped)``.

    ``full = (x, ids, weights, gate_up, down)`` over all ``e_total`` experts; ``rank`` is the same
    with the local ids (``id - lo`` inside ``[lo, hi)``, ``-1`` elsewhere) and the slices
    ``gate_up[lo:hi]``, ``down[lo:hi]`` (views of the full tensors); ``skipped [T, k]`` marks the
    ``-1`` pairs. Token 0 has every pair skipped, token 1 none, the others a random mix.

    Poison, so that reading a skipped pair's weights shows as NaN: every expert outside
    ``[lo, hi - 1)`` is NaN, among them ``lo - 1`` (right below the rank's slice: where ``-1`` lands
    used as an offset) and ``hi - 1`` (the rank's last: where ``-1`` lands wrapped as an index),
    and no pair is routed to ``hi - 1``; the skipped pairs' routing weights are NaN too. So the
    full call's skipped rows are NaN (never compared) and its other rows finite.
    """
    assert 1 <= lo < hi < e_total
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    gate_up = torch.randn(e_total, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(e_total, hidden, inter, generator=g) / inter**0.5
    usable = torch.tensor([e for e in range(e_total) if e != hi - 1])
    inside = usable[(usable >= lo) & (usable < hi)]
    pools = (usable[(usable < lo) | (usable >= hi)], inside)  # token 0, token 1
    assert min(len(pool) for pool in pools) >= k
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]]
                       for pool in (pools[i] if i < 2 else usable for i in range(t))])
    skipped = (ids < lo) | (ids >= hi)
    local = torch.where(skipped, -1, ids - lo)
    weights = torch.rand(t, k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    weights[skipped] = float("nan")
    poisoned = torch.ones(e_total, dtype=torch.bool)
    poisoned[lo : hi - 1] = False
    gate_up[poisoned] = float("nan")
    down[poisoned] = float("nan")
    x, weights, gate_up, down = (a.to(device, dtype) for a in (x, weights, gate_up, down))
    ids, local, skipped = ids.to(device), local.to(device), skipped.to(device)
    return ((x, ids, weights, gate_up, down), (x, local, weights, gate_up[lo:hi], down[lo:hi]),
            skipped)


SENTINEL = 3.0  # what every torch.empty buffer of a spied kernel module starts as


class SentinelTorch:
    """Stands in for ``torch`` in a kernel module (``monkeypatch.setattr(module, "torch", ...)``):
    each ``torch.empty`` comes back filled with :data:`SENTINEL` and is recorded, so a row that no
    kernel writes shows (a fresh allocation often holds zeros, which would pass for a written
    zero row)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def empty(self, *size, **kwargs) -> torch.Tensor:
        buffer = torch.empty(*size, **kwargs).fill_(SENTINEL)
        self.buffers.append(buffer)
        return buffer


def check_skipped_pairs(pairs_fn, full, rank, skipped, module=None, h_rows=None) -> torch.Tensor:
    """``pairs_fn(x, ids, weights, gate_up, down, **kw) -> [T, k, H]`` on :func:`ep_problem`'s
    problem: the rank's call with ``has_skipped_pairs`` gives every pair it keeps the full call's
    bits, and every skipped pair exact zeros (no NaN from the poisoned weights and routing
    weights); every pair skipped gives all zeros. Returns the rank's pairs.

    ``module``: the kernel module whose ``torch.empty`` buffers to fill with :data:`SENTINEL`
    (:class:`SentinelTorch`): then the returned pairs must be such a buffer (the zeros were
    written, not found) and the rows of the ``h`` buffer (2-D, ``I`` wide) that ``h_rows(local
    ids)`` selects (default: row ``p`` for each skipped pair ``p``) must still hold the sentinel:
    the gate_up kernel computed nothing for a skipped pair."""
    want = pairs_fn(*full)
    spy = SentinelTorch()
    with pytest.MonkeyPatch.context() as mp:
        if module is not None:
            mp.setattr(module, "torch", spy)
        got = pairs_fn(*rank, has_skipped_pairs=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not torch.isnan(want[~skipped]).any()  # the poison is only on the skipped pairs
    assert torch.equal(got[~skipped], want[~skipped])
    assert torch.all(got[skipped] == 0) and not torch.isnan(got).any()
    x, local, weights, gate_up, down = rank
    if module is not None:
        assert any(b is got for b in spy.buffers)
        (h,) = [b for b in spy.buffers if b.dim() == 2 and b.shape[1] == gate_up.shape[1] // 2]
        rows = (h_rows or (lambda ids: ids.reshape(-1) == -1))(local)
        assert rows.any() and torch.all(h[rows] == SENTINEL)
    none = pairs_fn(x, torch.full_like(local, -1), weights, gate_up, down, has_skipped_pairs=True)
    assert torch.equal(none, torch.zeros_like(got))
    return got


def _moe(e: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(hidden, e, k, inter, inter, routed_scaling_factor=2.5)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, hidden**-0.5)
        moe.e_score_correction_bias.uniform_(-0.1, 0.1)
    return moe.to(dtype).eval()


# ----------------------------------------------------------------------------- torch reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,e", [(1, 8, 64), (3, 2, 4), (16, 8, 64), (16, 4, 4), (5, 1, 4)])
def test_reference_equals_moe_experts_forward(t: int, k: int, e: int, dtype: torch.dtype) -> None:
    moe = _moe(e, k, 32, 16, dtype)
    x = torch.randn(t, 32).to(dtype)
    weights, ids = moe.route(x)
    ours = moe_experts_reference(x, ids, weights, moe.experts_gate_up, moe.experts_down)
    assert torch.equal(ours, moe.experts_forward(x, weights, ids))


def test_reference_skipped_pairs() -> None:
    """``has_skipped_pairs``: the -1 pairs add nothing, bitwise the global reference with those
    pairs' weights at zero (adding an exact zero changes no bit), and no weight of theirs is read
    (the poisoned experts and weights stay out of the sum)."""
    for dtype in (torch.float32, torch.bfloat16):
        full, rank, skipped = ep_problem(6, 3, 12, 3, 8, 32, 16, dtype, seed=4)
        got = moe_experts_reference(*rank, has_skipped_pairs=True)
        assert torch.all(got[0] == 0) and not torch.isnan(got).any()
        x, ids, w, gate_up, down = full
        finite = torch.where(torch.isnan(gate_up), 0, gate_up), torch.where(torch.isnan(down), 0, down)
        want = moe_experts_reference(x, ids, torch.where(skipped, 0, w), *finite)
        assert torch.equal(got, want)
        # no -1 with the flag on: the plain reference
        x, ids, w, gate_up, down = _problem(5, 2, 4, 32, 16, dtype, seed=1)
        assert torch.equal(moe_experts_reference(x, ids, w, gate_up, down, has_skipped_pairs=True),
                           moe_experts_reference(x, ids, w, gate_up, down))


def test_cpu_forward_never_takes_the_fused_path() -> None:
    moe = _moe(8, 2, 32, 16, torch.float32)
    x = torch.randn(4, 32)
    moe.use_fused_moe = True
    with torch.no_grad():
        fused_on = moe(x)
        moe.use_fused_moe = False
        fused_off = moe(x)
    assert torch.equal(fused_on, fused_off)
    assert not is_available("cpu")


# ----------------------------------------------------------------------------- interpreter

_CASES: list[dict] = [
    {"t": t, "k": k, "e": e, "hidden": 48, "inter": 24, "dtype": dt, "same": False}
    for t in (1, 3, 16) for k in (1, 2, 8) for e in (4, 64) for dt in ("float32", "bfloat16")
    if k <= e
] + [
    # two column blocks in gate_up, three in down, two K-loop steps in gate_up, ragged edges
    {"t": 3, "k": 2, "e": 4, "hidden": 160, "inter": 40, "dtype": dt, "same": False}
    for dt in ("float32", "bfloat16")
] + [
    # every token on experts 0..k-1: runs of 80 pairs span two 64-row tiles
    {"t": 80, "k": 2, "e": 4, "hidden": 32, "inter": 16, "dtype": "float32", "same": True},
    {"t": 16, "k": 8, "e": 64, "hidden": 32, "inter": 16, "dtype": "bfloat16", "same": True},
]


def _case_id(c: dict) -> str:
    return f"T{c['t']}-k{c['k']}-E{c['e']}-H{c['hidden']}-I{c['inter']}-{c['dtype']}" + (
        "-same" if c["same"] else ""
    )


def _run_interpreter_cases() -> dict[str, float]:
    """Runs in the subprocess (TRITON_INTERPRET=1): relative error of every case."""
    torch.set_num_threads(1)
    errors = {}
    for i, c in enumerate(_CASES):
        args = _problem(c["t"], c["k"], c["e"], c["hidden"], c["inter"], getattr(torch, c["dtype"]),
                        seed=i, same_experts=c["same"])
        out = fused_moe_experts(*args)
        assert out.dtype == args[0].dtype and out.shape == args[0].shape
        errors[_case_id(c)] = _rel_err(out, fp32_reference(*args))
    return errors


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return interpreter_script_json(__file__, timeout=300)


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_triton_interpreter_matches_reference(case: dict, interpreter_errors: dict[str, float]) -> None:
    err = interpreter_errors[_case_id(case)]
    assert err <= TOL[case["dtype"]], f"{_case_id(case)}: relative error {err:.3g}"


def test_interpreter_does_not_leak() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def test_interpreter_child() -> None:
    """The ``-k interpreted`` tests below, in a child pytest under ``TRITON_INTERPRET=1``."""
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__)


def _fused_pairs(*args, **kw) -> torch.Tensor:
    return fused_moe_experts(*args, reduce=False, **kw)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,k,e_total,lo,hi,hidden,inter", [
    (5, 3, 12, 3, 8, 48, 24),     # mixed tokens; one column block, a masked K step
    (4, 8, 40, 4, 14, 160, 40),   # more -1 pairs than a tile's 16 rows; two column blocks
])
def test_interpreted_skipped_pairs(t, k, e_total, lo, hi, hidden, inter, dtype) -> None:
    from laguna_dflash.kernels import fused_moe

    full, rank, skipped = ep_problem(t, k, e_total, lo, hi, hidden, inter, dtype, seed=t + k)
    assert k < 8 or int(skipped.sum()) > 16
    pairs = check_skipped_pairs(_fused_pairs, full, rank, skipped, module=fused_moe)
    # reduce: the skipped pairs add nothing (the same sum over the pairs, and the reference's)
    summed = fused_moe_experts(*rank, has_skipped_pairs=True)
    assert torch.equal(summed, pairs.sum(1))
    ref = moe_experts_reference(*(a.float() if a.is_floating_point() else a for a in rank),
                                has_skipped_pairs=True)
    assert _rel_err(summed, ref) <= TOL[str(dtype).removeprefix("torch.")]
    # a fixed block_m and max_tokens (the batch-invariant mode's call) keep the contract
    check_skipped_pairs(lambda *a, **kw: _fused_pairs(*a, block_m=16, max_tokens=64, **kw),
                        full, rank, skipped)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_skip_flag_without_skipped_pairs(dtype) -> None:
    """No -1 among the ids: the flag changes no bit (pairs and sum)."""
    args = _problem(16, 8, 64, 48, 24, dtype, seed=2)
    assert torch.equal(_fused_pairs(*args, has_skipped_pairs=True), _fused_pairs(*args))
    assert torch.equal(fused_moe_experts(*args, has_skipped_pairs=True), fused_moe_experts(*args))


# ----------------------------------------------------------------------------- Laguna-S-2.1

# top-10 routed + the folded shared expert = 11 pairs a token; expert / shared width 1024 (512 a
# rank under 2-way tensor parallelism); hidden 3072 (not a power of two)
S21 = {"e": 257, "k": 11, "hidden": 3072, "inter": 1024}


def s21_interpreter_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Larger tiles for the interpreted S-2.1 cases of the three MoE kernels (moe_gemv, fused,
    sorted): the interpreter costs ~20 ms a program step, and the default tiles at hidden 3072
    are ~1000 programs a kernel (minutes). 256 x 256 tiles divide 3072, 1024 and 512 as the
    defaults do (the widths stay unmasked on the K and N axes), so the same code paths run; the
    default tiles at full S-2.1 width run in the ``cuda`` S-2.1 tests."""
    from laguna_dflash.kernels import fused_moe, grouped_moe, moe_gemv

    for width in (S21["hidden"], S21["inter"], S21["inter"] // 2):
        for block in (*moe_gemv.GATE_UP_CONFIG[:2], *moe_gemv.DOWN_CONFIG[:2], *fused_moe._GATE_UP_CFG[:2],
                      *fused_moe._DOWN_CFG[:2], *grouped_moe._GATE_UP_CFG[:2], *grouped_moe._DOWN_CFG[:2], 256):
            assert width % block == 0, (width, block)
    monkeypatch.setattr(moe_gemv, "GATE_UP_CONFIG", (256, 256, 4))
    monkeypatch.setattr(moe_gemv, "DOWN_CONFIG", (256, 256, 4))
    for module in (fused_moe, grouped_moe):
        monkeypatch.setattr(module, "_GATE_UP_CFG", (256, 256, 4, 1))
        monkeypatch.setattr(module, "_DOWN_CFG", (256, 256, 4, 1))
    # the interpreter's fp32 dot would halve BLOCK_K to 16 (a GPU compile-time bound only)
    monkeypatch.setattr(fused_moe, "MAX_IEEE_FMAS_PER_THREAD", 1 << 30)


def s21_shared_ids(t: int, e: int, seed: int) -> torch.Tensor:
    """``[T, 11]``: 10 distinct routed experts of the first ``E - 1``, then the folded shared
    expert ``E - 1`` for every token (as ``MoE.fold_shared_expert`` routes it)."""
    g = torch.Generator().manual_seed(seed)
    routed = torch.stack([torch.randperm(e - 1, generator=g)[: S21["k"] - 1] for _ in range(t)])
    return torch.cat([routed, torch.full((t, 1), e - 1)], 1)


@interpreted
def test_interpreted_s21_eleven_pairs_hidden_3072(monkeypatch) -> None:
    """One decode token, 11 pairs (top-10 + shared), hidden 3072 (the gate_up K loop and the
    down kernel's 12 column blocks), fp32 against the reference. The expert
    width is shrunk (40, ragged) and so is the expert count (12): width 1024 / 512 run in the
    moe_gemv and sorted kernels' S-2.1 tests."""
    s21_interpreter_tiles(monkeypatch)
    x, _, w, gate_up, down = _problem(1, S21["k"], 12, S21["hidden"], 40, torch.float32, seed=21)
    ids = s21_shared_ids(1, 12, seed=21)
    args = (x, ids, w, gate_up, down)
    pairs = _fused_pairs(*args)  # reduce=True is this sum in torch (one launch pair: ~4 s here)
    assert pairs.shape == (1, S21["k"], S21["hidden"])
    assert _rel_err(pairs.sum(1), fp32_reference(*args)) <= TOL["float32"]


# ----------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not is_available("cuda"), reason="needs a CUDA GPU (sm80+) and triton")
XS = {"e": 256, "k": 8, "hidden": 2048, "inter": 512}


@cuda
@pytest.mark.parametrize("t", [1, 2, 4, 16, 32])
def test_cuda_xs21_shapes_match_reference(t: int) -> None:
    args = _problem(t, XS["k"], XS["e"], XS["hidden"], XS["inter"], torch.bfloat16, seed=t,
                    device="cuda")
    ref = fp32_reference(*args)
    ours = fused_moe_experts(*args)
    torch_path = moe_experts_reference(*args)  # the bf16 torch path, for scale
    assert _rel_err(ours, ref) <= max(TOL["bfloat16"], 2 * _rel_err(torch_path, ref))
    args32 = tuple(a.float() if a.is_floating_point() else a for a in args)
    assert _rel_err(fused_moe_experts(*args32), fp32_reference(*args32)) <= 1e-5


@cuda
def test_cuda_moe_forward_fused_vs_torch_and_graph_capture() -> None:
    moe = _moe(XS["e"], XS["k"], XS["hidden"], XS["inter"], torch.bfloat16).cuda()
    x = torch.randn(16, XS["hidden"], device="cuda", dtype=torch.bfloat16)
    moe.use_fused_moe = True
    with torch.no_grad():
        fused = moe(x)
        moe.use_fused_moe = False
        plain = moe(x)
        moe.use_fused_moe = True
        assert _rel_err(fused, plain) <= 3e-2  # routed (x2.5) + shared, bf16 both ways
        # static shapes, no host sync: capture once, replay on new inputs
        static_x = x.clone()
        moe(static_x)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe(static_x)
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, moe(static_x))  # deterministic: no atomics


def test_grouped_path_matches_reference_loop_on_cpu() -> None:
    """The sorted grouped-GEMM path (torch._grouped_mm) equals the per-expert loop."""
    moe = _moe(8, 2, 32, 16, torch.bfloat16)
    x = torch.randn(37, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        weights, ids = moe.route(x)
        grouped = moe.experts_forward_grouped(x, weights, ids)
        loop = moe.experts_forward(x, weights, ids)
    assert _rel_err(grouped, loop) <= 1e-2


def eager_then_graphed(fn):
    """``fn()`` eagerly with host syncs forbidden (after a first call that compiles), then
    captured into a CUDA graph and replayed -> (eager output, the graph's static output, the
    graph)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync would raise
    try:
        eager = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return eager, static_out, graph


@cuda
def test_cuda_skipped_pairs_xs21_and_graph_capture() -> None:
    """XS-2.1 widths (k 8 of 40 experts, 20 on this rank), bf16 and fp32: the rank's pairs are
    the global call's bits, the skipped ones zeros; no host sync; a captured graph replays a new
    routing (another skip pattern) as eager computes it."""
    from laguna_dflash.kernels import fused_moe

    for dtype in (torch.bfloat16, torch.float32):
        for t in (1, 4, 16, 32):
            full, rank, skipped = ep_problem(t, XS["k"], 40, 10, 30, XS["hidden"], XS["inter"], dtype,
                                             seed=t, device="cuda")
            check_skipped_pairs(_fused_pairs, full, rank, skipped, module=fused_moe)
    full, rank, skipped = ep_problem(16, XS["k"], 40, 10, 30, XS["hidden"], XS["inter"], torch.bfloat16,
                                     seed=5, device="cuda")
    x, local, w, gate_up, down = (a.clone() if a.dim() < 3 else a for a in rank)
    eager, static_out, graph = eager_then_graphed(
        lambda: fused_moe_experts(x, local, w, gate_up, down, has_skipped_pairs=True))
    assert torch.equal(static_out, eager)
    _, other, _ = ep_problem(16, XS["k"], 40, 10, 30, 8, 4, torch.bfloat16, seed=6)
    local.copy_(other[1])  # another routing, token 0 now all skipped too
    w.copy_(other[2])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fused_moe_experts(x, local, w, gate_up, down, has_skipped_pairs=True))
    assert not torch.isnan(static_out).any()


def _assert_graph_replays(moe: MoE, x: torch.Tensor, out: torch.Tensor) -> None:
    """``moe(x)`` captured in a CUDA graph replays ``out`` (its eager result) bit for bit."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_grouped_path_large_batch_and_graph_capture() -> None:
    """Above the fused kernel's pair limit the forward takes the sync-free grouped path: it
    matches the loop and captures in a CUDA graph."""
    moe = _moe(XS["e"], XS["k"], XS["hidden"], XS["inter"], torch.bfloat16).cuda()
    x = torch.randn(256, XS["hidden"], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        weights, ids = moe.route(x)
        assert _rel_err(moe.experts_forward_grouped(x, weights, ids),
                        moe.experts_forward(x, weights, ids)) <= 2e-2
        out = moe(x)
        _assert_graph_replays(moe, x, out)


@cuda
def test_cuda_float32_large_batch_takes_the_sorted_kernels_and_captures(monkeypatch) -> None:
    """float32 has no grouped GEMM: past ``fused_moe_max_pairs`` the forward takes the sorted
    Triton kernels (kernels/grouped_moe.py), not the fused ones (their O(P) in-program grouping
    at a prefill's thousands of pairs took ptxas minutes a kernel), matches the reference loop,
    and captures in a CUDA graph."""
    from laguna_dflash.kernels import grouped_moe

    calls = []
    sorted_experts = grouped_moe.sorted_moe_experts
    monkeypatch.setattr(grouped_moe, "sorted_moe_experts",
                        lambda *a, **kw: (calls.append(a[0].shape[0]), sorted_experts(*a, **kw))[1])
    moe = _moe(XS["e"], XS["k"], XS["hidden"], XS["inter"], torch.float32).cuda()
    x = torch.randn(600, XS["hidden"], device="cuda")
    with torch.no_grad():
        out = moe(x)
        assert calls == [600]
        moe.use_fused_moe = False
        assert _rel_err(out, moe(x)) <= TOL["float32"]  # the loop over the experts hit
        moe.use_fused_moe = True
        assert moe(x[:16]) is not None and calls == [600]  # 16 x 8 pairs: the fused kernels
        _assert_graph_replays(moe, x, out)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-cases"]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_run_interpreter_cases()))


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order() -> None:
    """With ``kernels.pdl.USE_PDL`` both kernels wait for their inputs before any global load and
    signal their dependents after the wait; off: no griddepcontrol (kernels/pdl.py)."""
    from laguna_dflash.kernels import fused_moe

    for kernel, types, constexprs in (
        (fused_moe._gate_up_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "h_ptr": "*bf16"},
         dict(K_TOP=9, H=2048, INTER=512)),
        (fused_moe._down_kernel, {"h_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*bf16",
                                  "out_ptr": "*bf16"}, dict(H=2048, INTER=512)),
    ):
        common = dict(P_PAD=64, M_TILES=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=False)
        for pdl, skip in ((False, False), (True, False), (True, True)):
            ptx = compile_sm90(kernel, types, {**constexprs, **common, "PDL": pdl, "SKIP_NEGATIVE": skip},
                               {"num_warps": 4, "num_stages": 4, "launch_pdl": pdl})
            if not pdl:
                assert "griddepcontrol" not in ptx
                continue
            assert loads_before_pdl_wait(ptx) == []  # skip build: the id is read after the wait


def test_ieee_block_k_bounds_a_threads_fmas() -> None:
    """The fp32 K step: unchanged where it fits, halved to fit, never below tl.dot's 16."""
    from laguna_dflash.kernels.fused_moe import MAX_IEEE_FMAS_PER_THREAD, ieee_block_k

    assert ieee_block_k(128, 16, 64, 4) == 128  # 16 * 64 * 128 / 128 threads = 1024
    assert ieee_block_k(128, 64, 32, 4, num_dots=2) == 32
    assert ieee_block_k(128, 64, 128, 1) == 16  # floor: 4096 a thread still
    for bm in (16, 32, 64):
        for bn, nw, dots in ((32, 4, 2), (64, 4, 1), (128, 4, 1), (64, 8, 2)):
            bk = ieee_block_k(128, bm, bn, nw, dots)
            assert bk >= 16 and (bk == 16 or dots * bm * bn * bk <= MAX_IEEE_FMAS_PER_THREAD * 32 * nw)


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("block_m", [16, 64])
def test_sm90_float32_builds_stay_small(block_m: int) -> None:
    """float32 MoE kernels as the launchers build them (the fused and the sorted ones, their K step
    from ``ieee_block_k``): at most MAX_IEEE_FMAS_PER_THREAD FMAs a thread in the PTX. At 4096
    (BLOCK_M 64, BLOCK_K 128 before the cap) ptxas ran for minutes a kernel and stalled the
    float32 engine's start-up on the H200."""
    from laguna_dflash.kernels import fused_moe, grouped_moe
    from laguna_dflash.kernels.fused_moe import MAX_IEEE_FMAS_PER_THREAD, ieee_block_k

    f32 = "*fp32"
    shapes = dict(H=2048, INTER=512)
    for kernel, cfg, dots, types, extra in (
        (fused_moe._gate_up_kernel, fused_moe._GATE_UP_CFG, 2,
         {"x_ptr": f32, "w_ptr": f32, "ids_ptr": "*i64", "h_ptr": f32},
         dict(K_TOP=8, P_PAD=512, M_TILES=1, SKIP_NEGATIVE=False)),
        (fused_moe._down_kernel, fused_moe._DOWN_CFG, 1,
         {"h_ptr": f32, "w_ptr": f32, "ids_ptr": "*i64", "rw_ptr": f32, "out_ptr": f32},
         dict(P_PAD=512, M_TILES=1, SKIP_NEGATIVE=False)),
        (grouped_moe._sorted_gate_up_kernel, grouped_moe._GATE_UP_CFG, 2,
         {"x_ptr": f32, "w_ptr": f32, "row_pair_ptr": "*i64", "tile_expert_ptr": "*i64", "h_ptr": f32},
         dict(K_TOP=8)),
        (grouped_moe._sorted_down_kernel, grouped_moe._DOWN_CFG, 1,
         {"h_ptr": f32, "w_ptr": f32, "row_pair_ptr": "*i64", "tile_expert_ptr": "*i64", "rw_ptr": f32,
          "out_ptr": f32}, dict(SKIP_NEGATIVE=False)),
    ):
        bn, bk, nw, ns = cfg
        bk = ieee_block_k(bk, block_m, bn, nw, dots)
        ptx = compile_sm90(kernel, types, {**shapes, **extra, "BLOCK_M": block_m, "BLOCK_N": bn,
                                           "BLOCK_K": bk, "IEEE": True, "PDL": False},
                           {"num_warps": nw, "num_stages": ns})
        assert ptx.count("fma.rn.f32") <= MAX_IEEE_FMAS_PER_THREAD, (kernel.__name__, block_m, bk)


@cuda
@pytest.mark.parametrize("inter", [1024, 512], ids=["width1024", "tp2-width512"])
@pytest.mark.parametrize("t", [1, 4, 16, 32])
def test_cuda_s21_shapes_match_reference(t: int, inter: int) -> None:
    """S-2.1 widths on the default tiles: 11 pairs a token (top-10 + the folded shared expert),
    hidden 3072, expert width 1024 (512 a rank under 2-way TP), bf16 and fp32."""
    x, _, w, gate_up, down = _problem(t, S21["k"], S21["e"], S21["hidden"], inter, torch.bfloat16, seed=t,
                                      device="cuda")
    args = (x, s21_shared_ids(t, S21["e"], seed=t).cuda(), w, gate_up, down)
    ref = fp32_reference(*args)
    torch_path = moe_experts_reference(*args)
    assert _rel_err(fused_moe_experts(*args), ref) <= max(TOL["bfloat16"], 2 * _rel_err(torch_path, ref))
    args32 = tuple(a.float() if a.is_floating_point() else a for a in args)
    assert _rel_err(fused_moe_experts(*args32), fp32_reference(*args32)) <= 1e-5
