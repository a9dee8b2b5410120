"""Tensor-parallel ranks for the tests (a helper module, not collected by pytest).

:func:`run_ranks` starts ``world_size`` CPU processes (gloo, the env a torchrun launch sets),
each runs every job of a list through ``LLM(..., tensor_parallel_size=world_size)``, and the
parent gets every rank's results: a test can check that the ranks agree and compare rank 0's
results with a single-process run or with transformers.

A job is a dict: ``{"kind": "prompt_logits", "model": DIR, "prompt": [ids]}`` ->
logits ``[T, V]`` float32; ``{"kind": "generate", "model": DIR, "draft": DIR | None,
"prompts": [[ids]], "max_tokens": N, "temperature": T (default 0), "options": {...}}`` -> ``(token ids per prompt, mean
acceptance length per prompt)``, plus each prompt's per-token ``{token: logprob}`` with
``"logprobs": N``; ``{"kind": "train_draft", "config": {...}}`` -> the drafter's weights after
``train-draft`` (data parallel over the ranks; ``"train_target"`` the same for ``train-target``); with ``"again": True`` ``(that, (token ids, num_cached_tokens) of the same
prompts generated a second time)`` (the prefix cache then holds them); ``{"kind": "drafter_layout", "model": DIR, "draft": DIR, "options": {...}}`` -> the rank's
drafter shape and where its context K/V lives; ``"options": {"trace": True}`` on a generate job
adds each prompt's per-step trace (anchor, draft tokens, accepted); ``{"kind": "batch_states",
"num_sequences": N, "idx": [ids]}`` -> this rank's ``train.draft.batch_states`` of a random
cache (seed 0, ``[N, 3, 4]`` and ``[N, 3, 8]``) kept one sequence in ``world_size`` a rank.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port below Linux's ephemeral range (32768-60999): a port the kernel handed
    out and this returned could be handed out again, e.g. to one of gloo's connections, before
    the caller binds it (seen: a server's port taken that way)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def run_job(job: dict, tensor_parallel_size: int):
    """One job in this process (any world size)."""
    from laguna_dflash import LLM, SamplingParams
    from laguna_dflash.engine import engine as engine_module

    if job.get("skip_warmup_prefills"):  # a CUDA engine's warm-up then decodes only
        engine_module.WARMUP_PREFILL_LENGTHS = ()
    if job["kind"] == "batch_states":
        from laguna_dflash.distributed import init_data_parallel
        from laguna_dflash.train.draft import batch_states

        dp = init_data_parallel(torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        n = job["num_sequences"]
        hidden, taps = torch.randn(n, 3, 4, generator=gen), torch.randn(n, 3, 8, generator=gen)
        share = len(job["idx"]) // dp.world_size
        kept = (hidden[dp.rank :: dp.world_size], taps[dp.rank :: dp.world_size])
        return batch_states(kept, torch.tensor(job["idx"]), slice(dp.rank * share, (dp.rank + 1) * share), dp)
    if job["kind"] == "train_draft":  # data parallel: -> the final training state's weights
        from laguna_dflash.train.draft import DraftTrainConfig, train_draft

        out = train_draft(DraftTrainConfig(**job["config"]))
        return torch.load(out / "work" / "train_state.pt", weights_only=False)["model"]
    if job["kind"] == "train_target":  # data parallel: -> the final training state's weights
        from laguna_dflash.train.target import TargetTrainConfig, train_target

        out = train_target(TargetTrainConfig(**job["config"]))
        return torch.load(out / "work" / "train_state.pt", weights_only=False)["model"]
    if job["kind"] == "drafter_layout":  # -> what a rank's drafter and its cache hold
        engine = LLM(model=job["model"], draft=job["draft"], tensor_parallel_size=tensor_parallel_size,
                     max_model_len=256, num_kv_blocks=64, **job.get("options", {})).engine
        layers = engine.drafter.layers
        return {"world_size": engine.drafter.tp.world_size, "num_kv_heads": engine.drafter.num_kv_heads,
                "qkv_rows": [layer.self_attn.qkv_proj.weight.shape[0] for layer in layers],
                "gate_up_rows": [layer.mlp.gate_up_proj.weight.shape[0] for layer in layers],
                "draft_group": engine.runner.kv_cache.draft_group,
                "num_own_draft_layers": engine._num_own_draft_layers}
    if job["kind"] == "prompt_logits":
        llm = LLM(model=job["model"], tensor_parallel_size=tensor_parallel_size,
                  max_model_len=256, num_kv_blocks=32, **job.get("options", {}))
        return llm.engine.prompt_logits(job["prompt"])
    params = SamplingParams(temperature=job.get("temperature", 0.0), max_tokens=job["max_tokens"],
                            ignore_eos=True, logprobs=job.get("logprobs"))
    if job["kind"] == "lead":
        return _lead_or_follow(job, params, tensor_parallel_size)
    llm = LLM(model=job["model"], draft=job.get("draft"), tensor_parallel_size=tensor_parallel_size,
              max_model_len=256, num_kv_blocks=64, **job.get("options", {}))
    outs = llm.generate(prompt_token_ids=job["prompts"], sampling_params=params)
    result = ([o.token_ids for o in outs],
              [o.metrics.get("mean_acceptance_length", 0.0) for o in outs])
    if job.get("options", {}).get("trace"):  # -> and each prompt's per-step drafts
        return result + ([o.metrics.get("trace", []) for o in outs],)
    if job.get("again"):
        again = llm.generate(prompt_token_ids=job["prompts"], sampling_params=params)
        return result, ([o.token_ids for o in again], [o.num_cached_tokens for o in again])
    return result + ([o.logprobs for o in outs],) if job.get("logprobs") is not None else result


def _lead_or_follow(job: dict, params, tensor_parallel_size: int):
    """A server's calls without HTTP: rank 0 leads (adds, steps, aborts request 1 after two
    steps, adds the last prompt late), the others follow -> token ids by request id.

    ``"fail_step": n``: the n-th step's forward raises on every rank (as a bad batch would);
    rank 0 then aborts that step's requests, as the server does, and adds the last prompt."""
    from laguna_dflash.engine.engine import LLMEngine, StepError
    from laguna_dflash.llm import LLM

    engine: LLMEngine = LLM(model=job["model"], draft=job.get("draft"),
                            tensor_parallel_size=tensor_parallel_size, max_model_len=256,
                            num_kv_blocks=64).engine
    if job.get("fail_step"):
        run, num_runs = engine._run, [0]

        def failing_run(batch):
            num_runs[0] += 1
            if num_runs[0] == job["fail_step"]:
                raise RuntimeError("injected step failure")
            return run(batch)

        engine._run = failing_run
    if not engine.tp.is_driver:
        return {s.request_id: s.output_token_ids for s in engine.follow()}
    engine.lead()
    *first, last = job["prompts"]
    seqs = [engine.add_request(p, params) for p in first]
    failed: list = []
    for _ in range(2):
        engine.step()
    engine.abort(seqs[1])
    if job.get("fail_step"):
        try:
            while engine.has_unfinished:
                engine.step()
        except StepError as e:
            failed = e.sequences
            for s in failed:
                engine.abort(s)
    seqs.append(engine.add_request(last, params))
    while engine.has_unfinished:
        engine.step()
    engine.stop_followers()
    return {s.request_id: s.output_token_ids for s in seqs
            if s is not seqs[1] and s not in failed}


def _rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str,
               backend: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a rank that diverges fails the test in minutes instead of waiting out the default 30
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=180))
    try:
        results = [run_job(job, world_size) for job in jobs]
        torch.save(to_cpu(results), Path(out_dir) / f"rank{rank}.pt")
    finally:
        from laguna_dflash.distributed import shutdown

        shutdown()


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def run_ranks(jobs: list[dict], world_size: int = 2, backend: str = "gloo") -> list[list]:
    """Every job on ``world_size`` tensor-parallel ranks (gloo: CPU; nccl: one GPU a rank, the
    jobs' ``options`` then say ``device="cuda"``) -> results[rank][job]."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(world_size, free_port(), jobs, out, backend),
                           nprocs=world_size, start_method="spawn", join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
