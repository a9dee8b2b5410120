"""Tensor parallelism (laguna_dflash/distributed.py) on CPU ranks over gloo.

Two processes, launched the way torchrun launches them, each load their shard of checkpoints
written by transformers' ``save_pretrained`` (and the other on-disk spellings real checkpoints
use). Checked: the sharded engine's prompt logits against transformers' own models; greedy
tokens of the sharded engine equal the single-process engine's, with and without DFlash, fixed
and adaptive K, and DFlash equals target-only on the ranks (lossless); every rank holds the same
results. Plus the loader's shard arithmetic and the errors a bad launch gets.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from laguna_dflash.distributed import SINGLE, Split, TensorParallel, init_tensor_parallel
from laguna_dflash.models.draft_vocab import save_token_map
from laguna_dflash.models.laguna import LagunaForCausalLM
from laguna_dflash.models.loader import load_model
from laguna_dflash.models.random_init import randomize_, tiny_laguna_config
from laguna_dflash.models.writer import save_checkpoint

BLOCK_SIZE = 4
NUM_NEW_TOKENS = 24
# CUDA engines of the tests: the graphs of the batch sizes used, captured when first needed
SMALL_CUDA = {"max_num_seqs": 4, "cuda_graph_capture": "lazy"}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 60) for _ in range(length)] for length in (3, 9, 17, 26, 5)[:n]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import dflash_fixtures as df
    import hf_fixtures as hf

    root = tmp_path_factory.mktemp("tp")
    sinks = hf.make_laguna_sink_checkpoint(root / "sinks")
    fused = hf.make_laguna_checkpoint(root / "fused", "xs_mini", seed=3)
    hf.rewrite_checkpoint_names(fused, "fused")  # experts [E, 2I, H] / [E, H, I] on disk
    laguna = df.make_tiny_laguna_target(root / "laguna", seed=0)
    qwen3 = df.make_tiny_qwen3_target(root / "qwen3", seed=0)
    # a draft vocabulary of ids from both ranks' halves of the lm_head, out of order
    token_map = save_token_map(torch.randperm(df.DEFAULT_VOCAB_SIZE, generator=torch.Generator().manual_seed(0))[:40],
                               root / "token_map.pt")
    dummy = root / "dummy"  # config.json only: --load-format dummy
    dummy.mkdir()
    (dummy / "config.json").write_text(json.dumps(tiny_laguna_config()))
    return {
        "token_map": token_map,
        "dummy": dummy,
        "sinks": sinks,
        "fused": fused,
        "tied": hf.make_laguna_checkpoint(root / "tied", "per_element_tied", seed=1),
        "qwen3_tied": hf.make_qwen3_checkpoint(root / "qwen3_tied", seed=2, variant="tied"),
        # Q/K/V biases split with the heads, the o_proj bias added once after the all-reduce
        "qwen3_bias": hf.make_qwen3_checkpoint(root / "qwen3_bias", seed=4, attention_bias=True),
        "laguna": laguna,
        "poolside": df.make_poolside_laguna_drafter(root / "poolside", laguna, seed=0,
                                                    block_size=BLOCK_SIZE),
        "qwen3": qwen3,
        "zlab": df.make_zlab_drafter(root / "zlab", qwen3, seed=0, num_layers=2,
                                     block_size=BLOCK_SIZE),
    }


LOGIT_CASES = {  # checkpoint -> transformers' sinks flag
    "sinks": True, "fused": None, "tied": None, "qwen3_tied": None, "qwen3_bias": None,
}
PROMPT = [3, 17, 5, 9, 42, 7, 11, 25, 31, 4]


def _generate_jobs(c: dict) -> dict[str, dict]:
    prompts = _prompts(5, seed=1)
    job = {"kind": "generate", "prompts": prompts, "max_tokens": NUM_NEW_TOKENS}
    return {
        "qwen3 target-only": {**job, "model": str(c["qwen3"])},
        "qwen3+zlab K=3": {**job, "model": str(c["qwen3"]), "draft": str(c["zlab"])},
        "qwen3+zlab adaptive": {**job, "model": str(c["qwen3"]), "draft": str(c["zlab"]),
                                "options": {"adaptive_k": True}},
        "laguna target-only": {**job, "model": str(c["laguna"])},
        "laguna+poolside K=3": {**job, "model": str(c["laguna"]), "draft": str(c["poolside"])},
        "qwen3+zlab lead/follow": {**job, "kind": "lead", "model": str(c["qwen3"]),
                                   "draft": str(c["zlab"])},
        "qwen3+zlab lead/follow, a failed step": {
            **job, "kind": "lead", "model": str(c["qwen3"]), "draft": str(c["zlab"]),
            "fail_step": 3},
        # the drafter's fp8 weights: each rank quantizes its own shard (row-parallel layers'
        # rows over their K shard, its vocabulary rows of the lm_head copy)
        "qwen3+zlab K=3 fp8": {**job, "model": str(c["qwen3"]), "draft": str(c["zlab"]),
                               "options": {"draft_quantization": "fp8"}},
        "laguna+poolside K=3 fp8": {**job, "model": str(c["laguna"]), "draft": str(c["poolside"]),
                                    "options": {"draft_quantization": "fp8"}},
        "qwen3+zlab sampled": {**job, "model": str(c["qwen3"]), "draft": str(c["zlab"]),
                               "temperature": 0.8},
        # each step's drafts: the sharded drafter against one process's (and the replicated one)
        "laguna+poolside traced": {**job, "model": str(c["laguna"]), "draft": str(c["poolside"]),
                                   "options": {"trace": True}},
        "laguna+poolside replicated, traced": {
            **job, "model": str(c["laguna"]), "draft": str(c["poolside"]),
            "options": {"trace": True, "draft_tensor_parallel_size": 1}},
        "qwen3+zlab traced": {**job, "model": str(c["qwen3"]), "draft": str(c["zlab"]),
                              "options": {"trace": True}},
        # a draft vocabulary: each rank fills the map's rows it holds, one sum makes the table
        "laguna+poolside token map, traced": {
            **job, "model": str(c["laguna"]), "draft": str(c["poolside"]),
            "options": {"trace": True, "speculative_token_map": str(c["token_map"])}},
        "qwen3+zlab fp8 token map, traced": {
            **job, "model": str(c["qwen3"]), "draft": str(c["zlab"]),
            "options": {"trace": True, "speculative_token_map": str(c["token_map"]),
                        "draft_quantization": "fp8"}},
    }


def _layout_jobs(c: dict) -> dict[str, dict]:
    job = {"kind": "drafter_layout", "model": str(c["laguna"]), "draft": str(c["poolside"])}
    return {"poolside sharded": job,
            "poolside replicated": {**job, "options": {"draft_tensor_parallel_size": 1}},
            "poolside sharded, asked": {**job, "options": {"draft_tensor_parallel_size": 2}}}


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    """Every job on two gloo ranks, in one launch: (logit jobs' names, generate jobs' names,
    results[rank][job])."""
    import tp_worker

    logit_jobs = {name: {"kind": "prompt_logits", "model": str(checkpoints[name]), "prompt": PROMPT}
                  for name in LOGIT_CASES}
    logit_jobs["dummy"] = {"kind": "prompt_logits", "model": str(checkpoints["dummy"]),
                           "prompt": PROMPT, "options": {"load_format": "dummy"}}
    gen_jobs = _generate_jobs(checkpoints)
    layout_jobs = _layout_jobs(checkpoints)
    results = tp_worker.run_ranks(list(logit_jobs.values()) + list(gen_jobs.values())
                                  + list(layout_jobs.values()), world_size=2)
    names = list(logit_jobs) + list(gen_jobs) + list(layout_jobs)
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(names)}, gen_jobs


@pytest.mark.parametrize("name", list(LOGIT_CASES))
def test_sharded_prompt_logits_match_transformers(checkpoints, two_ranks, name):
    import hf_fixtures as hf

    by_name, _ = two_ranks
    rank0, rank1 = by_name[name]
    want = hf.hf_prompt_logits(checkpoints[name], PROMPT, sinks=LOGIT_CASES[name])
    assert rank0.shape == want.shape
    torch.testing.assert_close(rank0, want, atol=5e-5, rtol=1e-4)
    assert torch.equal(rank0, rank1), "the ranks' logits differ: an all-reduce/gather is missing"


def test_dummy_weights_are_the_same_model_at_every_rank_count(two_ranks, checkpoints):
    """``--load-format dummy`` on two ranks builds the one-rank model's weights, sharded: the
    prompt logits match one process's."""
    import tp_worker

    by_name, _ = two_ranks
    rank0, rank1 = by_name["dummy"]
    one = tp_worker.run_job({"kind": "prompt_logits", "model": str(checkpoints["dummy"]),
                             "prompt": PROMPT, "options": {"load_format": "dummy"}}, 1)
    torch.testing.assert_close(rank0, one, atol=5e-5, rtol=1e-4)
    assert torch.equal(rank0, rank1)


def test_randomize_gives_each_rank_its_part_of_the_one_rank_values(tmp_path):
    """A rank's dummy weights equal what the loader reads for that rank from the one-rank
    dummy model's checkpoint (the loader's shards are checked against transformers above)."""
    cfg = tiny_laguna_config()
    one = LagunaForCausalLM.from_config(cfg)
    randomize_(one, seed=3)
    save_checkpoint(one, tmp_path, cfg)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        dummy = LagunaForCausalLM.from_config(cfg, tp=tp)
        randomize_(dummy, seed=3)
        loaded = dict(load_model(tmp_path, tp=tp).named_parameters())
        num_sharded = 0
        for name, p in dummy.named_parameters():
            num_sharded += p.shape != dict(one.named_parameters())[name].shape
            assert torch.equal(p.detach(), loaded[name].detach()), name
        assert num_sharded >= 10


def test_randomize_gives_each_rank_its_part_of_the_one_rank_drafter(tmp_path):
    """The same for a drafter sharded with its target (``--load-format dummy`` drafts as the
    one-rank drafter would): each rank's dummy drafter equals its shard of the one-rank one's
    checkpoint, and ``fc`` and the norms stay whole."""
    from laguna_dflash.models.laguna_dflash import DFlashLaguna
    from laguna_dflash.models.random_init import tiny_laguna_draft_config

    cfg = tiny_laguna_config()
    dcfg = tiny_laguna_draft_config(cfg)
    one = DFlashLaguna.from_config(dcfg, {}, LagunaForCausalLM.from_config(cfg))
    randomize_(one, seed=5)
    save_checkpoint(one, tmp_path, dcfg)
    whole = dict(one.named_parameters())
    for rank in range(2):
        target = LagunaForCausalLM.from_config(cfg, tp=TensorParallel(rank, 2))
        dummy = DFlashLaguna.from_config(dcfg, {}, target)
        assert dummy.tp is target.tp  # sharded with the target by default
        randomize_(dummy, seed=5)
        loaded = dict(load_model(tmp_path, target=target).named_parameters())
        sharded = set()
        for name, p in dummy.named_parameters():
            if p.shape != whole[name].shape:
                sharded.add(name)
            assert torch.equal(p.detach(), loaded[name].detach()), name
        assert {"fc.weight", "hidden_norm.weight", "norm.weight"}.isdisjoint(sharded)
        assert {"layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.o_proj.weight",
                "layers.0.mlp.gate_up_proj.weight", "layers.0.mlp.down_proj.weight"} <= sharded


def test_sharded_greedy_tokens_equal_single_process(two_ranks):
    import tp_worker

    by_name, jobs = two_ranks
    for name, job in jobs.items():
        if job["kind"] != "generate" or job.get("temperature"):
            continue
        rank0, rank1 = by_name[name]
        assert rank0 == rank1, f"{name}: the ranks' outputs differ"
        single = tp_worker.run_job(job, tensor_parallel_size=1)
        assert rank0[0] == single[0], f"{name}: tensor-parallel tokens differ from one process"
        assert all(len(t) == NUM_NEW_TOKENS for t in rank0[0])


def test_sharded_sampling_draws_the_same_tokens_on_every_rank(two_ranks):
    """Temperature 0.8 with DFlash: every rank's sampler draws from the same gathered logits
    with the same generator, so the ranks keep emitting the same tokens (else their next
    forwards would diverge)."""
    by_name, jobs = two_ranks
    rank0, rank1 = by_name["qwen3+zlab sampled"]
    assert rank0 == rank1
    greedy = by_name["qwen3+zlab K=3"][0][0]
    assert rank0[0] != greedy, "temperature 0.8 drew the greedy tokens for every prompt"


def test_followers_replay_the_leaders_adds_aborts_and_steps(two_ranks):
    """A server's engine calls (requests arriving between steps, one aborted mid-generation)
    made on rank 0 only; rank 1 follows: both finish the same requests with the same tokens,
    which equal one process making those calls."""
    import tp_worker

    by_name, jobs = two_ranks
    name = "qwen3+zlab lead/follow"
    leader, follower = by_name[name]
    assert len(leader) == len(jobs[name]["prompts"]) - 1  # the aborted one is not reported
    assert follower == leader
    assert tp_worker.run_job(jobs[name], tensor_parallel_size=1) == leader
    assert all(len(t) == NUM_NEW_TOKENS for t in leader.values())


def test_followers_survive_a_failed_step(two_ranks):
    """A step that raises on every rank: rank 0 aborts that step's requests (as the server
    fails them), the follower replays the aborts, and both serve the request added after."""
    import tp_worker

    by_name, jobs = two_ranks
    name = "qwen3+zlab lead/follow, a failed step"
    leader, follower = by_name[name]
    assert follower == leader
    assert leader == tp_worker.run_job(jobs[name], tensor_parallel_size=1)
    last = max(leader)  # the request added after the failure, served in full
    assert len(leader) == 1 and len(leader[last]) == NUM_NEW_TOKENS


def test_sharded_dflash_is_lossless_and_accepts_drafts(two_ranks):
    by_name, _ = two_ranks
    for target, spec_names in (("qwen3", ("qwen3+zlab K=3", "qwen3+zlab adaptive", "qwen3+zlab K=3 fp8")),
                               ("laguna", ("laguna+poolside K=3", "laguna+poolside K=3 fp8"))):
        want = by_name[f"{target} target-only"][0][0]
        for name in spec_names:
            assert by_name[name][0][0] == want, f"{name} differs from target-only on the ranks"
    # the distilled drafter's drafts are accepted, so the multi-token accept path ran sharded
    for name in ("qwen3+zlab K=3", "qwen3+zlab K=3 fp8"):  # fp8 drafts are still accepted
        acceptance = by_name[name][0][1]
        assert sum(acceptance) / len(acceptance) > 1.3, (name, acceptance)


def test_the_drafter_is_sharded_as_the_target_and_keeps_its_context_in_the_pool(two_ranks, checkpoints):
    """By default (and with draft_tensor_parallel_size = 2) each rank holds half of every
    drafter layer's heads, KV heads and MLP width, so its K/V rows are the target's and its
    context K/V takes a sliding group of the target's pool; with draft_tensor_parallel_size = 1
    it is replicated and keeps a cache of its own."""
    import tp_worker

    by_name, _ = two_ranks
    single = tp_worker.run_job(_layout_jobs(checkpoints)["poolside sharded"], tensor_parallel_size=1)
    assert single["world_size"] == 1 and single["draft_group"] > 0  # the drafter slides
    for name in ("poolside sharded", "poolside sharded, asked"):
        for rank in by_name[name]:
            assert rank["world_size"] == 2
            assert rank["num_kv_heads"] * 2 == single["num_kv_heads"]
            assert [2 * n for n in rank["qkv_rows"]] == single["qkv_rows"]
            assert [2 * n for n in rank["gate_up_rows"]] == single["gate_up_rows"]
            assert rank["draft_group"] > 0 and rank["num_own_draft_layers"] == 0
    for rank in by_name["poolside replicated"]:
        assert rank["world_size"] == 1 and rank["qkv_rows"] == single["qkv_rows"]
        assert rank["draft_group"] == 0 and rank["num_own_draft_layers"] == len(single["qkv_rows"])


def test_the_sharded_drafter_drafts_what_one_process_drafts(two_ranks):
    """Every spec step's draft tokens and accepted count, sharded (and replicated) drafter on
    two ranks, equal one process's: the sharded layers compute the same drafts (float32)."""
    import tp_worker

    by_name, jobs = two_ranks
    kept = ("speculative_token_map", "draft_quantization")  # the drafter's options one process takes too
    for name in ("laguna+poolside traced", "laguna+poolside replicated, traced", "qwen3+zlab traced",
                 "laguna+poolside token map, traced", "qwen3+zlab fp8 token map, traced"):
        rank0, rank1 = by_name[name]
        assert rank0 == rank1, f"{name}: the ranks differ"
        options = {key: value for key, value in jobs[name]["options"].items() if key in kept}
        single = tp_worker.run_job({**jobs[name], "options": {**options, "trace": True}}, tensor_parallel_size=1)
        assert rank0[0] == single[0], f"{name}: tokens differ from one process"
        assert rank0[2] == single[2], f"{name}: drafts differ from one process"
        steps = [step for trace in rank0[2] for step in trace]
        assert len(steps) > 10 and sum(step["num_accepted"] for step in steps) > 0
        if "token map" in name:  # drafted from the map only; the output is target-only's
            allowed = set(torch.load(jobs[name]["options"]["speculative_token_map"]).tolist())
            assert {t for step in steps for t in step["draft_tokens"]} <= allowed
            base = "laguna target-only" if name.startswith("laguna") else "qwen3 target-only"
            assert rank0[0] == by_name[base][0][0], f"{name}: not the target's tokens"


# ---- no processes ----------------------------------------------------------------------------


def test_split_reads_each_segment_chunk():
    full = torch.arange(24 * 3).view(24, 3)  # rows: Q (12) | K (6) | V (6), two ranks
    got = [Split(0, r, 2, (6, 3, 3)).read(full) for r in range(2)]
    assert torch.equal(got[0], torch.cat([full[0:6], full[12:15], full[18:21]]))
    assert torch.equal(got[1], torch.cat([full[6:12], full[15:18], full[21:24]]))
    cols = Split(1, 1, 3)
    assert torch.equal(cols.read(full), full[:, 1:2])
    assert cols.disk_shape((24, 1)) == (24, 3)


def test_split_reads_only_its_part_of_a_safetensors_slice(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = torch.randn(4, 10, 6)  # experts [E, 2I, H] with I = 5
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        part = Split(1, 1, 5, (1, 1)).read(f.get_slice("w"))
    assert torch.equal(part, torch.cat([full[:, 1:2], full[:, 6:7]], dim=1))


def test_indivisible_heads_name_the_field_and_the_flag():
    from laguna_dflash.models.layers import MLP

    with pytest.raises(ValueError, match="intermediate_size=10 is not divisible by tensor_parallel_size=4"):
        MLP(8, 10, tp=TensorParallel(0, 4))


def test_parallel_size_without_a_launch_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        init_tensor_parallel(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="at least 1"):
        init_tensor_parallel(0, torch.device("cpu"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 launched ranks but tensor_parallel_size=1"):
        init_tensor_parallel(1, torch.device("cpu"))


def test_cli_serve_under_torchrun(checkpoints, tmp_path):
    """``torchrun --nproc-per-node 2 -m laguna_dflash serve --tensor-parallel-size 2``: rank 0
    serves over HTTP, rank 1 follows; greedy completions equal one process's, a bad request
    gets a 400 and the server keeps serving, and SIGINT stops both ranks."""
    import os
    import signal
    import subprocess
    import sys

    import httpx
    import tp_worker
    from serve_process import wait_until_healthy

    from laguna_dflash import LLM, SamplingParams

    port = tp_worker.free_port()
    target, draft = str(checkpoints["qwen3"]), str(checkpoints["zlab"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(tp_worker.free_port()), "-m", "laguna_dflash", "serve",
           "--model", target, "--draft", draft, "--port", str(port),
           "--max-model-len", "128", "--num-kv-blocks", "40", "--tensor-parallel-size", "2"]
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    prompts = _prompts(3, seed=7)
    try:
        wait_until_healthy(proc, url, log, timeout_s=120)
        got = []
        for p in prompts:
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": target, "prompt": p, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        bad = httpx.post(url + "/v1/completions", timeout=60,
                         json={"model": target, "prompt": prompts[0], "max_tokens": -1})
        assert bad.status_code == 400 and "max_tokens" in bad.text
        again = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": target, "prompt": prompts[0], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == got[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single = LLM(target, draft=draft, max_model_len=128, num_kv_blocks=40)
    want = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want, log.read_text()
    assert proc.returncode is not None


def _check_sharded_on_cuda(checkpoints: dict, options: dict, backend: str) -> None:
    """The generate jobs (fixed K) on two ``backend`` ranks with CUDA ``options``: the ranks
    agree, equal one process on the GPU, and DFlash equals target-only."""
    import tp_worker

    jobs = {name: {**job, "options": {"device": "cuda", **options}}
            for name, job in _generate_jobs(checkpoints).items()
            if job["kind"] == "generate" and "adaptive" not in name and "traced" not in name}
    results = tp_worker.run_ranks(list(jobs.values()), world_size=2, backend=backend)
    for i, (name, job) in enumerate(jobs.items()):
        assert results[0][i] == results[1][i], f"{name}: the ranks' outputs differ"
        single = tp_worker.run_job(job, tensor_parallel_size=1)
        assert results[0][i][0] == single[0], f"{name}: sharded differs from one process"
    assert results[0][1][0] == results[0][0][0]  # qwen3+zlab = qwen3 target-only


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs (NCCL)")
def test_sharded_engine_on_two_gpus_with_cuda_graphs(checkpoints):
    """NCCL ranks, float32, CUDA graphs (the all-reduces and gathers captured in them)."""
    _check_sharded_on_cuda(checkpoints, SMALL_CUDA, "nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sharded_engine_on_one_gpu_over_gloo(checkpoints):
    """Two gloo ranks sharing one GPU (eager: gloo cannot be captured in a CUDA graph): the
    CUDA kernels at the sharded shapes (float32)."""
    _check_sharded_on_cuda(checkpoints, {"enforce_eager": True}, "gloo")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_collectives_replay_inside_the_engines_cuda_graphs(checkpoints, monkeypatch):
    """One GPU, one NCCL rank, but every collective of the sharded path called (a group of one):
    the all-reduces and vocabulary gathers are recorded into the engine's CUDA graphs (decode,
    verify, drafter block) and replayed; greedy tokens equal the plain engine's."""
    import datetime

    import torch.distributed as dist
    import tp_worker

    from laguna_dflash import LLM, SamplingParams
    from laguna_dflash.engine import engine as engine_module

    class OneRankCollectives(TensorParallel):
        @property
        def is_parallel(self) -> bool:
            return True

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(tp_worker.free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        tp = OneRankCollectives(0, 1, dist.group.WORLD, dist.new_group(backend="gloo"))
        monkeypatch.setattr(engine_module, "init_tensor_parallel", lambda *_: tp)
        captured = []
        real_all_reduce = TensorParallel.all_reduce

        def counting_all_reduce(self, x):
            captured.append(torch.cuda.is_current_stream_capturing())
            return real_all_reduce(self, x)

        monkeypatch.setattr(TensorParallel, "all_reduce", counting_all_reduce)
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        prompts = _prompts(3, seed=5)
        target, draft = str(checkpoints["qwen3"]), str(checkpoints["zlab"])
        sharded = LLM(target, draft=draft, device="cuda", max_model_len=256, num_kv_blocks=64,
                      num_speculative_tokens=3, **SMALL_CUDA)
        assert sharded.engine.runner.graphs is not None
        got = [o.token_ids for o in sharded.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert any(captured), "no all-reduce was recorded into a CUDA graph"
        del sharded
        monkeypatch.setattr(engine_module, "init_tensor_parallel", lambda *_: SINGLE)
        plain = LLM(target, draft=draft, device="cuda", max_model_len=256, num_kv_blocks=64,
                    num_speculative_tokens=3, **SMALL_CUDA)
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want
    finally:
        dist.destroy_process_group()


def test_cli_generate_under_torchrun_prints_once(checkpoints):
    """``torchrun --nproc-per-node 2 -m laguna_dflash generate --tensor-parallel-size 2 --json``:
    one JSON object (rank 0's), with one process's greedy tokens."""
    import json
    import os
    import subprocess
    import sys

    import tp_worker

    from laguna_dflash import LLM, SamplingParams

    target, draft = str(checkpoints["qwen3"]), str(checkpoints["zlab"])
    prompt = _prompts(1, seed=3)[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(tp_worker.free_port()), "-m", "laguna_dflash", "generate",
           "--model", target, "--draft", draft, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-new-tokens", "16", "--ignore-eos", "--json", "--tensor-parallel-size", "2",
           "--max-model-len", "128"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = LLM(target, draft=draft, max_model_len=128).generate(
        prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
    assert json.loads(lines[0])["token_ids"] == want


def test_cli_generate_compare_under_torchrun(checkpoints):
    """``generate --compare`` (the demo pair's default) under torchrun: every rank runs the
    target-only comparison too (it failed when rank 0 alone built that sharded engine)."""
    import json
    import os
    import subprocess
    import sys

    import tp_worker

    prompt = _prompts(1, seed=3)[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(tp_worker.free_port()), "-m", "laguna_dflash", "generate",
           "--model", str(checkpoints["qwen3"]), "--draft", str(checkpoints["zlab"]),
           "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8", "--ignore-eos",
           "--json", "--compare", "--tensor-parallel-size", "2", "--max-model-len", "128"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout
    assert json.loads(lines[0])["timings"]["outputs_identical"] is True


def wide_qwen3_pair(root) -> tuple[str, str]:
    """A 2-layer Qwen3 target of hidden 1024 (the invariant kernels at realistic tile counts) and
    an undistilled 1-layer z-lab drafter for it."""
    import dflash_fixtures as df

    target = df.make_tiny_qwen3_target(root / "qwen3_wide", seed=0, hidden_size=1024,
                                       intermediate_size=2816, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=64, num_hidden_layers=2)
    draft = df.make_zlab_drafter(root / "zlab_wide", target, seed=0, num_layers=1,
                                 block_size=BLOCK_SIZE, distill_steps=0)
    return str(target), str(draft)


def invariant_logprob_jobs(target: str, draft: str, batch_invariant: bool) -> list[dict]:
    """bf16 on two ranks (gloo, one GPU, eager): the first prompt alone and in a batch of five,
    target-only and with DFlash K = 3, with the chosen tokens' logprobs."""
    options = {"device": "cuda", "dtype": "bfloat16", "batch_invariant": batch_invariant,
               "enforce_eager": True}
    prompts = _prompts(5, seed=1)
    job = {"kind": "generate", "model": target, "max_tokens": NUM_NEW_TOKENS, "logprobs": 0,
           "options": options}
    return [{**job, "prompts": prompts[:1]}, {**job, "prompts": prompts},
            {**job, "prompts": prompts[:1], "draft": draft},
            {**job, "prompts": prompts, "draft": draft}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batch_invariant_holds_on_two_ranks_in_bf16(tmp_path):
    """``--batch-invariant`` runs on two ranks (gloo sharing one GPU, eager, bf16): the ranks
    agree, the first prompt's logprobs are bitwise the same alone, in a batch of five and
    verified by DFlash instead of decoded, and greedy DFlash equals target-only. Each rank's
    kernels are batch-invariant and a two-rank all-reduce is one (commutative) addition, so
    this must hold. It is a guard of the mode under TP, not a proof that TP needs the mode:
    on the H200 the same jobs WITHOUT the mode also gave equal logprobs (eager dense GEMMs at
    these sizes did not change with the row count; the batch dependence the twentieth pass
    measured came from the graphed kernels, which gloo cannot capture)."""
    import tp_worker

    results = tp_worker.run_ranks(invariant_logprob_jobs(*wide_qwen3_pair(tmp_path), True),
                                  world_size=2, backend="gloo")
    assert results[0] == results[1], "the ranks' outputs differ"
    alone, batch, spec_alone, spec_batch = results[0]
    first = [r[2][0] for r in (alone, batch, spec_alone, spec_batch)]  # the first prompt's logprobs
    assert all(lp == first[0] for lp in first[1:])
    assert spec_batch[0] == batch[0]


def test_draft_tensor_parallel_size_is_checked_against_the_targets():
    """1 replicates, the target's size shards, None lets the drafter's widths choose; any other
    size (or a non-integer) is an error naming the flag."""
    from types import SimpleNamespace

    from laguna_dflash.config import SpeculativeConfig, from_vllm_speculative_config
    from laguna_dflash.engine.engine import LLMEngine

    tp = TensorParallel(rank=1, world_size=2)
    engine = SimpleNamespace(tp=tp)
    for size, want in ((None, None), (1, SINGLE), (2, tp)):
        got = LLMEngine._draft_tp(engine, SpeculativeConfig(draft="d", draft_tensor_parallel_size=size))
        assert got is want
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=4 \(--draft-tensor-parallel-size\)"
                                         r" must be 1 .* tensor_parallel_size \(2"):
        LLMEngine._draft_tp(engine, SpeculativeConfig(draft="d", draft_tensor_parallel_size=4))
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="draft_tensor_parallel_size must be an integer >= 1"):
            SpeculativeConfig(draft="d", draft_tensor_parallel_size=bad)
    assert from_vllm_speculative_config(
        {"method": "dflash", "model": "d", "draft_tensor_parallel_size": 2}, "w")[2] == 2
    with pytest.raises(ValueError, match="w draft_tensor_parallel_size must be a JSON integer"):
        from_vllm_speculative_config({"model": "d", "draft_tensor_parallel_size": "2"}, "w")
    from laguna_dflash import LLM

    with pytest.raises(ValueError, match="draft_tensor_parallel_size was given without draft="):
        LLM("/no/such/model", draft_tensor_parallel_size=1)
    with pytest.raises(ValueError, match="give the drafter once"):
        LLM("/no/such/model", speculative_config={"model": "d"}, draft_tensor_parallel_size=1)


def test_a_drafter_whose_widths_do_not_divide_the_ranks_is_replicated(caplog):
    """resolve_draft_tp: the target's ranks when the drafter's heads, KV heads and MLP width all
    divide them, else replicated (logged); an explicit choice is kept."""
    from types import SimpleNamespace

    from laguna_dflash.models.dflash import DraftLayerSpec, DraftSpec, resolve_draft_tp
    from laguna_dflash.models.rope import RopeSpec

    def spec(num_heads: int, num_kv_heads: int, intermediate: int) -> DraftSpec:
        return DraftSpec(hidden_size=32, target_hidden_size=32, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=8, intermediate_size=intermediate,
                         rope=RopeSpec.from_dict({"rope_theta": 1e4}, 8, 64),
                         layers=(DraftLayerSpec(None, False),), target_layer_ids=(1,),
                         block_size=4, mask_token_id=0)

    tp = TensorParallel(rank=0, world_size=2)
    target = SimpleNamespace(tp=tp)
    assert resolve_draft_tp(spec(8, 2, 64), target, None) is tp
    for widths in ((6, 3, 64), (8, 2, 63)):
        with caplog.at_level("INFO", logger="laguna_dflash.models.dflash"):
            assert resolve_draft_tp(spec(*widths), target, None) is SINGLE
        assert "replicated on every rank" in caplog.text
    assert resolve_draft_tp(spec(8, 2, 64), target, SINGLE) is SINGLE
    assert resolve_draft_tp(spec(8, 2, 64), SimpleNamespace(tp=SINGLE), None) is SINGLE
