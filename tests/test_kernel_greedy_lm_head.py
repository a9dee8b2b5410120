"""Greedy tokens through the lm_head's int8 copy (``kernels/greedy_lm_head.py``).

The oracle is ``torch.argmax`` over the exact logits. The problems are built so that every logit
is exact in fp32 whatever the summation order: small integer weights and activations, scaled by
powers of two. So the kernel's answer must equal ``torch.argmax`` of the float64 logits rounded to
the dtype, ties (lowest index) included. The int8 copy is not exact on these weights, so the
bounds and the full-precision pass are exercised. One case checks that the int8 argmax alone gets
it wrong.

* Here: :func:`quantize`'s copy and bounds against float64; bad inputs.
* Under Triton's CPU interpreter (a child pytest): M = 1, 3 and 16; vocabularies not a multiple of
  the chunk or block; duplicate rows (exact ties); NaN and infinite activations.
* On CUDA: the same at Laguna-XS-2.1's lm_head shape (100352 x 2048), random weights.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

from laguna_dflash.kernels import greedy_lm_head as glh


def exact_problem(m: int, v: int, h: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """(x, weight): integer-valued multiples of powers of two, so that each logit (at most h * 16
    * 8 in units of 2^-7) is exact in fp32 and in the dtype's rounding of it."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-8, 9, (m, h), generator=g) / 8).to(dtype)
    w = (torch.randint(-15, 16, (v, h), generator=g) / 16).to(dtype)
    return x.to(device), w.to(device)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.argmax((x.double() @ w.double().T).to(x.dtype), dim=-1)


# ---- quantize ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_bounds_hold_in_float64(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 96, generator=g) * 0.05).to(dtype)
    w[7] = 0  # an all-zero row
    head = glh.quantize(w, rows_per_step=128)  # three blocks
    assert head.q.dtype == torch.int8 and head.q.shape == w.shape
    assert int(head.q.abs().max()) == 127 and int(head.q[7].abs().max()) == 0 and head.scale[7] == 1
    w64 = w.double()
    deq = head.scale.double()[:, None] * head.q.double()
    assert torch.all(head.err.double() >= (w64 - deq).norm(dim=1))
    assert torch.all(head.norm.double() >= w64.norm(dim=1))
    assert torch.all(head.err.double() <= (w64 - deq).norm(dim=1) * (1 + 1e-6) + 1e-30)
    # the copy's error is what int8 gives: at most half a step a weight
    assert torch.all((w64 - deq).abs() <= head.scale.double()[:, None] / 2 * (1 + 1e-5))
    assert head.nbytes == 300 * 96 + 3 * 300 * 4


def test_slack_covers_both_fp32_sums():
    # two sums of k terms, each off by at most k 2^-23 of ||x|| ||w_v|| (truncating adds)
    for k in (64, 2048, 3072, 4096, 8192, 16384):
        assert glh.slack(k) >= 2 * k * 2.0**-23
    assert glh.slack(2048) == glh.slack(3072) == glh.SLACK  # Laguna's hidden sizes
    assert glh.slack(8192) > glh.SLACK


def test_quantize_and_can_use_reject_other_weights():
    with pytest.raises(ValueError, match="bf16 / fp16"):
        glh.quantize(torch.zeros(4, 8))
    x, w = exact_problem(1, 64, 32, torch.bfloat16, seed=0)
    head = glh.quantize(w)
    assert not glh.can_use(x, w, None)
    assert not glh.can_use(x.float(), w, head)
    assert not glh.can_use(torch.zeros(17, 32, dtype=torch.bfloat16), w, head)  # past 16 rows
    assert not glh.can_use(x, w[:, :16], head)
    if not INTERPRETED:  # the CPU without the interpreter runs no Triton
        assert not glh.can_use(x, w, head)
        with pytest.raises(ValueError, match="lm_head GEMM and argmax"):
            glh.greedy_tokens(x, w, head)


def test_candidates_reference_keeps_the_argmax_and_few_others():
    """The torch form of the bound: the exact argmax is always a candidate; on Gaussian weights
    (the benchmarks') the candidates are a small share of the vocabulary; a non-finite row takes
    every token."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    w = (torch.randn(20000, 256, generator=g) * 0.02).to(torch.bfloat16)
    head = glh.quantize(w)
    mask = glh.candidates_reference(x, head)
    assert mask.shape == (3, 20000) and mask.dtype == torch.bool
    best = reference(x, w)
    assert bool(mask.gather(1, best[:, None]).all())
    assert 1 <= int(mask.sum(dim=1).max()) < 2000, mask.sum(dim=1)
    x[1, 0] = float("nan")
    mask = glh.candidates_reference(x, head)
    assert bool(mask[1].all()) and int(mask[0].sum()) < 2000


# ---- Triton kernels (CPU interpreter) ------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__, timeout=600)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,v,h", [(1, 5000, 256), (3, 4160, 96), (16, 700, 64)])
def test_interpreted_equals_argmax_of_exact_logits(m, v, h, dtype):
    x, w = exact_problem(m, v, h, dtype, seed=m + v)
    # exact ties: copies of the best rows later in the vocabulary (the first must win), and a
    # copy of row 0's best at the very last token
    best = reference(x, w)
    for r, t in enumerate(best.tolist()):
        w[v - 1 - r] = w[t]
    head = glh.quantize(w)
    got = glh.greedy_tokens(x, w, head)
    assert got.dtype == torch.int64 and got.shape == (m,)
    assert torch.equal(got, reference(x, w))
    assert torch.equal(got, best)  # the copies come later: the first index wins


@interpreted
@pytest.mark.parametrize("exact_chunk", [256, 1024])
def test_interpreted_exact_pass_in_smaller_chunks(exact_chunk, monkeypatch):
    """The exact pass's chunk (``EXACT_CHUNK``) apart from the bounds' (``CHUNK``): the same
    tokens, ties and a ragged last chunk included."""
    monkeypatch.setattr(glh, "EXACT_CHUNK", exact_chunk)
    x, w = exact_problem(3, 4160, 96, torch.bfloat16, seed=11)
    best = reference(x, w)
    for r, t in enumerate(best.tolist()):
        w[4160 - 1 - r] = w[t]
    assert torch.equal(glh.greedy_tokens(x, w, glh.quantize(w)), best)


@interpreted
def test_interpreted_also_into_gets_the_same_tokens():
    """``also_into``: the finish kernel stores the tokens there too (a decode graph's input ids),
    and only its first M entries; the returned tensor is a separate one."""
    x, w = exact_problem(3, 4160, 96, torch.bfloat16, seed=12)
    into = torch.full((5,), -7, dtype=torch.int64)
    got = glh.greedy_tokens(x, w, glh.quantize(w), also_into=into[:3])
    assert torch.equal(got, reference(x, w))
    assert torch.equal(into[:3], got) and into[3:].tolist() == [-7, -7]
    assert got.data_ptr() != into.data_ptr()


def test_also_into_of_the_wrong_shape_or_dtype_is_refused(monkeypatch):
    x, w = exact_problem(2, 300, 64, torch.bfloat16, seed=13)
    head = glh.quantize(w)
    monkeypatch.setattr(glh, "can_use", lambda *args: True)  # the check before any launch
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                torch.zeros(2, 2, dtype=torch.int64)[:, 0]):
        with pytest.raises(ValueError, match="also_into must be \\[2\\] int64 contiguous"):
            glh.greedy_tokens(x, w, head, also_into=bad)


@interpreted
def test_interpreted_exact_pass_corrects_the_int8_argmax():
    """Two tokens whose int8 logits rank them the wrong way round: the full-precision rows decide."""
    h = 64
    x = torch.ones(1, h, dtype=torch.bfloat16)
    w = torch.zeros(8, h, dtype=torch.bfloat16)
    w[:, 0] = 1.0  # every row's max|w| is 1: scale 1 / 127, logit 1 + the rest
    w[2, 1:] = 0.4 / 127  # q = 0: int8 logit 1, exact 1 + 63 * 0.4 / 127 = 1.198
    w[5, 33:] = 0.6 / 127  # q = 1: int8 logit 1 + 31 / 127 = 1.244, exact 1 + 31 * 0.6 / 127 = 1.146
    head = glh.quantize(w)
    int8_logits = (x.float() @ (head.scale[:, None] * head.q.float()).T)[0]
    assert int(torch.argmax(int8_logits)) == 5  # the int8 copy alone picks row 5
    want = reference(x, w)
    assert int(want[0]) == 2
    assert torch.equal(glh.greedy_tokens(x, w, head), want)


@interpreted
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_interpreted_non_finite_rows_take_the_full_logits(value):
    """A NaN or an infinity in a row of x: every token is a candidate, and the answer is
    ``torch.argmax`` of the full logits (a NaN ranks first); the other rows are unaffected."""
    x, w = exact_problem(2, 3000, 64, torch.bfloat16, seed=5)
    x[1, 3] = value
    head = glh.quantize(w)
    got = glh.greedy_tokens(x, w, head)
    logits = (x.double() @ w.double().T).to(torch.bfloat16)
    assert torch.equal(got, torch.argmax(logits, dim=-1))


# ---- offline sm_90 builds ------------------------------------------------------------------------


def _sm90(kernel, constexprs: dict, num_warps: int) -> tuple[str, list[int]]:
    from ptx_sm90 import compile_sm90_spills

    types = {"x_ptr": "*bf16", "i_ptr": "*bf16", "err_ptr": "*fp32", "norm_ptr": "*fp32", "lo_ptr": "*fp32",
             "hi_ptr": "*fp32", "cx_ptr": "*fp32", "w_ptr": "*bf16", "part_v_ptr": "*fp32",
             "part_i_ptr": "*i64", "out_ptr": "*i64", "out2_ptr": "*i64"}
    options = {"num_warps": num_warps, "num_stages": 1, "launch_pdl": constexprs["PDL"]}
    return compile_sm90_spills(kernel, types, constexprs, options)


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("use_pdl", [True, False], ids=["pdl", "plain"])
def test_sm90_builds_read_only_the_bounds_before_the_pdl_wait(use_pdl):
    """At XS-2.1's lm_head shape the bounds, exact and finish kernels build for sm_90 without
    spills; as programmatic dependent launches (kernels/pdl.py) each waits once, signals after
    it, and reads before it only the copy's err and norm rows (the bounds kernel's 2048 tokens:
    four 16-byte loads of each a thread; the exact kernel's 256: one 8-byte load of each)."""
    from ptx_sm90 import can_compile_sm90, loads_before_pdl_wait

    from laguna_dflash.kernels import argmax
    from laguna_dflash.kernels.jit import DTYPE_CODE

    if not can_compile_sm90():
        pytest.skip("needs triton's CUDA backend")
    bounds, exact = glh._kernels(False)
    common = dict(stride_xm=2048, stride_im=100352, SLACK=glh.slack(2048), K=2048, BLOCK_H=2048, PDL=use_pdl)
    builds = [
        (_sm90(bounds, dict(common, CHUNK=2048), 4), 8),
        (_sm90(exact, dict(common, stride_w=2048, CHUNK=256, BLOCK_B=64, DTYPE=DTYPE_CODE[torch.bfloat16]), 4), 2),
        (_sm90(argmax._kernels(False)[1], dict(BLOCK_C=512, PDL=use_pdl, HAS_OUT2=True), 1), 0),
    ]
    for (ptx, spills), loads in builds:
        assert spills == [0]
        if use_pdl:
            assert len(loads_before_pdl_wait(ptx)) == loads
        else:
            assert "griddepcontrol" not in ptx


# ---- CUDA ----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("m", [1, 4, 16])
def test_cuda_xs_lm_head_equals_argmax_of_exact_logits(m):
    x, w = exact_problem(m, 100352, 2048, torch.bfloat16, seed=m, device="cuda")
    head = glh.quantize(w)
    assert glh.can_use(x, w, head)
    assert torch.equal(glh.greedy_tokens(x, w, head), reference(x, w))


@cuda
@pytest.mark.parametrize("m", [1, 4])
def test_cuda_random_weights_pick_a_maximal_logit(m):
    """Gaussian weights and activations as the dummy XS-2.1 engine has them: the token's exact
    logit is the row's maximum (float64 sums rounded to bf16; another fp32 order can move a
    logit by one unit in the last place, so ties with the float64 argmax are allowed)."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 2048, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(100352, 2048, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    head = glh.quantize(w)
    got = glh.greedy_tokens(x, w, head)
    logits = (x.double() @ w.double().T)
    top = logits.max(dim=-1).values
    picked = logits.gather(1, got[:, None])[:, 0]
    assert torch.all(picked >= top - top.abs() * 2**-7), (picked, top)
    assert torch.equal(got, torch.argmax(logits.to(torch.bfloat16), dim=-1)) or m > 1


# ---- the engine (CPU interpreter) ------------------------------------------------------------------


@interpreted
def test_interpreted_engine_greedy_steps_take_the_int8_copy(tmp_path, monkeypatch):
    """With ``engine.greedy_int8_lm_head`` a bf16 engine's all-greedy steps take their tokens from
    the int8 copy (target-only and DFlash, batch 2), and the drafter its drafts: the tokens and
    drafts the logits path gives. A batch with a logprobs request takes the logits for its
    verify (and still the same tokens)."""
    import dflash_fixtures as df

    from laguna_dflash import LLM, SamplingParams
    from laguna_dflash.engine import engine as engine_module
    from laguna_dflash.models.decoder import DecoderLM

    target, draft = df.make_laguna_poolside_pair(tmp_path, block_size=4)
    calls = []
    real = DecoderLM.greedy_tokens
    def spy(self, hidden, also_into=None):  # the rows of each call that took the copy
        tokens = real(self, hidden, also_into)
        if tokens is not None:
            calls.append(hidden.shape[0])
        return tokens

    monkeypatch.setattr(DecoderLM, "greedy_tokens", spy)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)

    def run(switch: bool, params: list[SamplingParams], **options) -> list[tuple]:
        monkeypatch.setattr(engine_module, "greedy_int8_lm_head", switch)
        llm = LLM(target, dtype="bfloat16", block_size=4, max_num_seqs=2, trace=True, **options)
        assert (llm.engine.target.lm_head_int8 is not None) == switch
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        # the tokens, and each DFlash step's drafts (the drafter's argmax: the same either way)
        return [(o.token_ids, [t["draft_tokens"] for t in o.metrics.get("trace", [])]) for o in outs]

    for options in ({}, {"draft": draft, "num_speculative_tokens": 3}):
        want = run(False, [greedy, greedy], **options)
        assert not calls
        assert run(True, [greedy, greedy], **options) == want
        # a decode's 2 rows; a verify's 2 x 4 and a drafter block's 2 x 3
        assert sorted(set(calls)) == ([6, 8] if options else [2]), calls
        calls.clear()
    assert all(drafts for _, drafts in want)
    # a request with logprobs in the batch: the logits path for the verify (the drafts still take
    # the copy), the same tokens
    assert run(True, [greedy, with_logprobs], **options) == want
    assert set(calls) == {6}


@interpreted
def test_interpreted_staged_decode_takes_the_argmax_in_place(tmp_path, monkeypatch):
    """Target-only greedy steps through the graph runner's padded path (run eagerly here) with
    the forward queued ahead: its rows staged before the lm_head (``stage_forward_ahead``), the
    int8 argmax writing the next forward's ids in place (no copy), at batch 1 and 2 (padded to
    2): the tokens of the engine without staging."""
    import dflash_fixtures as df

    from laguna_dflash import LLM, SamplingParams
    from laguna_dflash.engine import engine as engine_module

    target, _ = df.make_laguna_poolside_pair(tmp_path, block_size=4)
    monkeypatch.setattr(engine_module, "decode_ahead", True)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]

    def run(staging: bool) -> tuple[list, list]:
        monkeypatch.setattr(engine_module, "stage_forward_ahead", staging)
        llm = LLM(target, dtype="bfloat16", block_size=4, max_num_seqs=2)
        llm.engine.attach_graph_runners()
        in_place = []
        run_staged = llm.engine.runner.run_staged

        def spy(staged, ids, *args, **kwargs):
            in_place.append(ids.data_ptr() == staged.ids.data_ptr())
            return run_staged(staged, ids, *args, **kwargs)

        llm.engine.runner.run_staged = spy
        outs = [o.token_ids for p in ([params[0]], params)
                for o in llm.generate(prompt_token_ids=prompts[: len(p)], sampling_params=p)]
        return outs, in_place

    want, never = run(False)
    assert never == []
    got, in_place = run(True)
    assert got == want
    assert len(in_place) >= 6 and all(in_place), in_place
