"""Expert parallelism (``--enable-expert-parallel``) on CPU ranks over gloo.

Each rank holds ``num_experts / world_size`` whole routed experts (attention, dense MLPs, the
shared expert and the vocabulary stay tensor-parallel). Checked: the sharded prompt logits
against transformers' own ``LagunaForCausalLM`` from both on-disk expert spellings; greedy
tokens equal one process's, with and without DFlash, and DFlash equals target-only (lossless);
dummy weights are the same model at every rank count; each expert path (the CPU loop, the
gather, the grouped GEMM) gives the one-rank output once the ranks' parts are summed, skipped
pairs (another rank's experts) adding exactly nothing; bad sizes get an error naming the flag.
"""

from __future__ import annotations

import json

import pytest
import torch

from laguna_dflash.distributed import TensorParallel
from laguna_dflash.models.laguna import LagunaForCausalLM
from laguna_dflash.models.layers import MoE
from laguna_dflash.models.loader import load_model
from laguna_dflash.models.random_init import randomize_, tiny_laguna_config
from laguna_dflash.models.writer import save_checkpoint

EP = {"enable_expert_parallel": True}
PROMPT = [3, 17, 5, 9, 42, 7, 11, 25, 31, 4]
NUM_NEW_TOKENS = 24
BLOCK_SIZE = 4


def _ep_rank(rank: int, world_size: int = 2) -> TensorParallel:
    return TensorParallel(rank, world_size, expert_parallel=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import dflash_fixtures as df
    import hf_fixtures as hf

    root = tmp_path_factory.mktemp("ep")
    fused = hf.make_laguna_checkpoint(root / "fused", "xs_mini", seed=3)
    hf.rewrite_checkpoint_names(fused, "fused")  # experts [E, 2I, H] / [E, H, I] on disk
    laguna = df.make_tiny_laguna_target(root / "laguna", seed=0)
    dummy = root / "dummy"
    dummy.mkdir()
    (dummy / "config.json").write_text(json.dumps(tiny_laguna_config()))
    return {
        "per_expert": hf.make_laguna_sink_checkpoint(root / "sinks"),  # experts.{e}.gate_proj...
        "fused": fused,
        "laguna": laguna,
        "poolside": df.make_poolside_laguna_drafter(root / "poolside", laguna, seed=0,
                                                    block_size=BLOCK_SIZE),
        "dummy": dummy,
    }


LOGIT_CASES = {"per_expert": True, "fused": None}  # checkpoint -> transformers' sinks flag


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    """Every job on two gloo ranks with expert parallelism, in one launch."""
    import tp_worker

    jobs = {name: {"kind": "prompt_logits", "model": str(checkpoints[name]), "prompt": PROMPT,
                   "options": EP} for name in LOGIT_CASES}
    jobs["dummy"] = {"kind": "prompt_logits", "model": str(checkpoints["dummy"]), "prompt": PROMPT,
                     "options": {**EP, "load_format": "dummy"}}
    prompts = [[5, 9, 2, 44], [7, 1, 8, 30, 12, 6, 19, 3, 11], [40, 41, 42]]
    gen = {"kind": "generate", "prompts": prompts, "max_tokens": NUM_NEW_TOKENS,
           "model": str(checkpoints["laguna"]), "options": EP}
    jobs["target-only"] = gen
    jobs["dflash K=3"] = {**gen, "draft": str(checkpoints["poolside"])}
    jobs["dflash K=3, prompts again"] = {**jobs["dflash K=3"], "again": True,  # > one KV block
                                         "prompts": [list(range(3, 23)), list(range(5, 45))]}
    jobs["dflash K=3, chunked prefill"] = {**jobs["dflash K=3"], "prompts": [list(range(5, 45))],
                                           "options": {**EP, "max_num_batched_tokens": 8}}
    results = tp_worker.run_ranks(list(jobs.values()), world_size=2)
    return {name: (job, [results[r][i] for r in range(2)]) for i, (name, job) in enumerate(jobs.items())}


@pytest.mark.parametrize("name", list(LOGIT_CASES))
def test_expert_parallel_prompt_logits_match_transformers(checkpoints, two_ranks, name):
    import hf_fixtures as hf

    _, (rank0, rank1) = two_ranks[name]
    want = hf.hf_prompt_logits(checkpoints[name], PROMPT, sinks=LOGIT_CASES[name])
    torch.testing.assert_close(rank0, want, atol=5e-5, rtol=1e-4)
    assert torch.equal(rank0, rank1), "the ranks' logits differ: an all-reduce is missing"


def test_expert_parallel_dummy_weights_are_the_one_rank_model(two_ranks, checkpoints):
    import tp_worker

    job, (rank0, rank1) = two_ranks["dummy"]
    one = tp_worker.run_job({**job, "options": {"load_format": "dummy"}}, 1)
    torch.testing.assert_close(rank0, one, atol=5e-5, rtol=1e-4)
    assert torch.equal(rank0, rank1)


def test_expert_parallel_greedy_equals_one_process_and_dflash_is_lossless(two_ranks):
    import tp_worker

    job, (rank0, rank1) = two_ranks["target-only"]
    assert rank0 == rank1
    single = tp_worker.run_job({**job, "options": {}}, 1)
    assert rank0[0] == single[0], "expert-parallel tokens differ from one process"
    assert all(len(t) == NUM_NEW_TOKENS for t in rank0[0])
    _, (spec0, spec1) = two_ranks["dflash K=3"]
    assert spec0 == spec1
    assert spec0[0] == rank0[0], "DFlash differs from target-only with expert parallelism"


def test_sharded_ranks_chunk_prefills_alike(two_ranks):
    """A 40-token prompt in chunks of 8 on two ranks: the ranks agree with each other and with
    one process computing it whole."""
    import tp_worker

    job, (rank0, rank1) = two_ranks["dflash K=3, chunked prefill"]
    assert rank0 == rank1
    whole = tp_worker.run_job({**job, "options": {"enable_chunked_prefill": False}}, 1)
    assert rank0[0] == whole[0]


def test_sharded_ranks_share_the_prefix_cache_decisions(two_ranks):
    """The same prompts again on two ranks: every rank finds them in its prefix cache (the
    ranks' schedulers decide alike) and generates the same tokens as the first time."""
    _, (rank0, rank1) = two_ranks["dflash K=3, prompts again"]
    assert rank0 == rank1
    first, (tokens, num_cached) = rank0
    assert tokens == first[0] and all(n > 0 for n in num_cached), num_cached


# ---- no processes ----------------------------------------------------------------------------


def test_each_rank_holds_its_experts_whole(tmp_path):
    """Dummy weights and the loader give rank ``r`` experts ``4r .. 4r+3`` of the one-rank
    model, at full width; the router, the shared expert's split and attention as under plain
    tensor parallelism. Both expert spellings on disk load the same values."""
    import hf_fixtures as hf

    cfg = tiny_laguna_config()  # 8 experts
    one = LagunaForCausalLM.from_config(cfg)
    randomize_(one, seed=3)
    save_checkpoint(one, tmp_path / "per_expert", cfg)
    save_checkpoint(one, tmp_path / "fused", cfg)
    hf.rewrite_checkpoint_names(tmp_path / "fused", "fused")
    whole = one.layers[1].mlp
    for rank in range(2):
        tp = _ep_rank(rank)
        dummy = LagunaForCausalLM.from_config(cfg, tp=tp)
        randomize_(dummy, seed=3)
        moe = dummy.layers[1].mlp
        assert (moe.first_expert, moe.num_local_experts) == (4 * rank, 4)
        experts = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(moe.experts_gate_up, whole.experts_gate_up[experts])
        assert torch.equal(moe.experts_down, whole.experts_down[experts])
        assert torch.equal(moe.gate.weight, whole.gate.weight)
        for spelling in ("per_expert", "fused"):
            loaded = dict(load_model(tmp_path / spelling, tp=tp).named_parameters())
            for name, p in dummy.named_parameters():
                assert torch.equal(p.detach(), loaded[name].detach()), (spelling, name)


def _moe(tp: TensorParallel, hidden: int = 16, num_experts: int = 8, top_k: int = 3,
         inter: int = 16, std: float = 0.3) -> MoE:
    """An MoE with seeded random parameters (no shared expert): the one-rank module, or rank
    ``tp.rank``'s experts of the same parameters (expert parallelism)."""
    torch.manual_seed(0)  # the same parameters at every rank count (the ranks slice them)
    whole = MoE(hidden, num_experts, top_k, inter, 0, routed_scaling_factor=2.5)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=std)
    if not tp.shards_experts:
        return whole
    moe = MoE(hidden, num_experts, top_k, inter, 0, routed_scaling_factor=2.5, tp=tp)
    experts = slice(moe.first_expert, moe.first_expert + moe.num_local_experts)
    with torch.no_grad():
        moe.gate.weight.copy_(whole.gate.weight)
        moe.e_score_correction_bias.copy_(whole.e_score_correction_bias)
        moe.experts_gate_up.copy_(whole.experts_gate_up[experts])
        moe.experts_down.copy_(whole.experts_down[experts])
    return moe


@pytest.mark.parametrize("path", ["experts_forward", "experts_forward_gather", "experts_forward_grouped"])
def test_expert_paths_sum_over_ranks_to_the_one_rank_output(path):
    """A rank's output covers its experts' pairs only; the ranks' outputs add up to the one-rank
    output (what the MoE's all-reduce computes). ``experts_forward_grouped`` leaves the skipped
    pairs' rows unwritten, so it must mask them (bf16: ``torch._grouped_mm``'s dtype)."""
    dtype = torch.bfloat16 if path == "experts_forward_grouped" else torch.float32
    if path == "experts_forward_grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    x = torch.randn(7, 16, dtype=dtype)
    whole = _moe(TensorParallel()).to(dtype)
    weights, ids = whole.route(x)
    want = getattr(whole, path)(x, weights, ids).float()
    parts = []
    for rank in range(4):
        moe = _moe(_ep_rank(rank, 4)).to(dtype)
        local = moe.local_ids(ids)
        assert ((local == -1) == ((ids < 2 * rank) | (ids >= 2 * rank + 2))).all()
        part = getattr(moe, path)(x, weights, local).float()
        assert part.isfinite().all()
        parts.append(part)
    got = sum(parts)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    # a rank whose experts no token chose returns exact zeros
    nobody = _moe(_ep_rank(0, 4)).to(dtype)
    none_local = torch.full_like(ids, -1)
    assert torch.equal(getattr(nobody, path)(x, weights, none_local).float(), torch.zeros_like(want))


def test_indivisible_experts_name_the_field_and_the_flag():
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by tensor_parallel_size=3 "
                                         "with --enable-expert-parallel"):
        MoE(16, 8, 2, 12, 0, tp=_ep_rank(0, 3))
    # expert parallelism keeps each expert's width whole: no width divisibility needed
    moe = MoE(16, 8, 2, 6, 0, tp=_ep_rank(1, 4))
    assert moe.experts_gate_up.shape == (2, 12, 16)
    assert moe.local_ids(torch.tensor([[0, 2, 3, 7]])).tolist() == [[-1, 0, 1, -1]]


def test_cli_and_server_pass_the_flag():
    from laguna_dflash.cli import build_parser, engine_options
    from laguna_dflash.config import EngineConfig

    args = build_parser().parse_args(["generate", "--model", "m", "-tp", "2", "--enable-expert-parallel",
                                      "--prompt-ids", "1,2"])
    assert engine_options(args)["enable_expert_parallel"] is True
    assert EngineConfig(model="m").enable_expert_parallel is False


def _cuda_moe(tp: TensorParallel, dtype: torch.dtype) -> MoE:
    """A Laguna-like MoE (16 experts, top-8, H 256, I 128) on the GPU (:func:`_moe`)."""
    return _moe(tp, hidden=256, num_experts=16, top_k=8, inter=128, std=0.1).to("cuda", dtype).eval()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 8, 64])  # the GEMV, fused and (bf16) grouped paths
def test_cuda_expert_parallel_moe_in_graphs_sums_to_the_one_rank_output(num_tokens, dtype):
    """Each rank's MoE (its experts' pairs; the others skipped by the kernels) replayed from a
    CUDA graph equals its eager forward bitwise, and the ranks' outputs add up to the one-rank
    module's (what the all-reduce computes)."""
    x = torch.randn(num_tokens, 256, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = _cuda_moe(TensorParallel(), dtype)._forward(x, keep_pairs=False).float()
        total = torch.zeros_like(want)
        for rank in range(4):
            moe = _cuda_moe(_ep_rank(rank, 4), dtype)
            eager = moe._forward(x, keep_pairs=False)
            moe._forward(x, keep_pairs=False)  # warm-up (compiles) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe._forward(x, keep_pairs=False)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"rank {rank}: graph replay differs from eager"
            assert out.isfinite().all()
            total += eager.float()
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(total, want, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expert_parallel_engine_on_one_gpu_over_gloo(checkpoints):
    """Two gloo ranks sharing one GPU (eager, float32: the fused MoE kernels, the sorted ones past
    256 pairs, with the other rank's pairs skipped): greedy tokens equal one process's; DFlash = target-only."""
    import tp_worker

    prompts = [[5, 9, 2, 44], [7, 1, 8, 30, 12, 6, 19, 3, 11]]
    gen = {"kind": "generate", "prompts": prompts, "max_tokens": NUM_NEW_TOKENS,
           "model": str(checkpoints["laguna"]), "skip_warmup_prefills": True,
           "options": {**EP, "device": "cuda", "enforce_eager": True}}
    jobs = [gen, {**gen, "draft": str(checkpoints["poolside"])}]
    results = tp_worker.run_ranks(jobs, world_size=2, backend="gloo")
    assert results[0] == results[1]
    single = tp_worker.run_job({**gen, "options": {"device": "cuda", "enforce_eager": True}}, 1)
    assert results[0][0][0] == single[0]
    assert results[0][1][0] == results[0][0][0]
