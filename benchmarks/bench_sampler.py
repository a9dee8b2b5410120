"""What sampling, penalties and logprobs cost a step: the engine's batched code against the
per-request loops it replaced (kept in this file as they were, as the baselines).

The engine samples outside the CUDA graphs, eagerly, once a step over the target's logits
``[R * rows, V]`` (rows = 1 at target-only decode, K + 1 at a verify). Until this benchmark's
commit ``sample_rows`` filtered and raced each sampled request on its own (about 20 launches a
request); the baseline here is that loop, kept in this file as it was. Both are timed in the
same process on the same logits: wall time per call including the host's launches, the device
synchronised after each call (the step waits for its tokens), median of ``--iters``.

``seeded``: the baseline draws each request's noise from its own ``torch.Generator`` (at a
verify a row at a time, recording the state after each: the engine's mechanism before the
counter-based noise); the batched code takes every seeded row's noise from one
``counter_exponential`` launch (kernels/counter_noise.py). The "same picks" column compares the
batched picks with the loop fed that counter noise (untimed), so it checks the batched filter
and race, not the noise source.

    python benchmarks/bench_sampler.py                     # on the H200: V = 100352, bf16
    python benchmarks/bench_sampler.py --device cpu --vocab 4096 --iters 3   # wiring check

``--what penalties`` times ``penalties.penalized_rows`` (presence, frequency and repetition
penalties, a 1024-token prompt, 256 outputs, the verify's drafts counted) and ``--what
logprobs`` the logprobs of a step (5 a token) the same way. Prints one markdown table per
part: batch x rows x mode -> loop us, batched us, speedup. The claim is the ratio within a run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from laguna_dflash.config import SamplingParams
from laguna_dflash.engine.penalties import penalized_rows
from laguna_dflash.engine.runner import to_device_async
from laguna_dflash.engine.sampler import sample_rows, top_logprobs
from laguna_dflash.engine.sequence import Sequence
from laguna_dflash.kernels.argmax import argmax_rows
from laguna_dflash.kernels.counter_noise import counter_exponential, seed_key

MODES = {
    "greedy": dict(temperature=0.0),
    "temp": dict(temperature=0.7),
    "top-p": dict(temperature=0.7, top_p=0.95, top_k=50),
    "seeded": dict(temperature=0.7, top_p=0.95),
}


def loop_filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-request filter as it was (baseline): ``[n, V]`` -> float32 probabilities."""
    scores = logits.float() / p.temperature
    vocab = scores.shape[-1]
    if p.min_p > 0.0:
        floor = scores.max(dim=-1, keepdim=True).values + math.log(p.min_p)
        scores = scores.masked_fill(scores < floor, float("-inf"))
    if 0 < p.top_k < vocab:
        kth = torch.topk(scores, p.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def loop_sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None], rows: int,
                     states: dict[int, list] | None,
                     positions: list[int] | None = None) -> torch.Tensor:
    """The per-request sampling loop as it was (baseline). ``positions`` (the untimed agreement
    check): a seeded request takes the counter noise at its positions instead of its generator's
    draws."""
    out = argmax_rows(logits)
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.is_greedy:
            continue
        block = slice(i * rows, (i + 1) * rows)
        probs = loop_filtered_probs(logits[block], p)
        noise = torch.empty_like(probs)
        own_states = states.get(i) if states else None
        if positions is not None and p.seed is not None:
            counter_exponential(torch.full((rows,), seed_key(p.seed), device=logits.device),
                                torch.arange(positions[i], positions[i] + rows, device=logits.device),
                                noise.shape[-1], logits.device, out=noise)
        elif own_states is None:
            noise.exponential_(generator=gen)
        else:
            for r in range(noise.shape[0]):
                noise[r].exponential_(generator=gen)
                own_states.append(gen.get_state())
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        out[block] = argmax_rows(probs / noise)
    return out


def loop_apply_penalties(rows: torch.Tensor, seq: Sequence, drafts: torch.Tensor | None) -> torch.Tensor:
    """One request's penalties as they were (baseline; presence / frequency / repetition)."""
    p = seq.params
    n, vocab = rows.shape
    device = rows.device
    tokens = to_device_async(torch.tensor(seq.prompt_token_ids + seq.output_token_ids, dtype=torch.long), device)
    num_prompt = len(seq.prompt_token_ids)
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    counts.index_add_(1, tokens[num_prompt:], torch.ones(1, tokens.numel() - num_prompt, device=device).expand(n, -1))
    if drafts is not None and n > 1:
        one_hot = torch.zeros(n - 1, vocab, dtype=torch.float32, device=device)
        one_hot.scatter_(1, drafts[: n - 1].view(-1, 1).to(torch.long), 1.0)
        counts[1:] += one_hot.cumsum(0)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, tokens[:num_prompt]] = True
        rep = p.repetition_penalty
        rows.copy_(torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows))
    if p.frequency_penalty:
        rows -= p.frequency_penalty * counts
    if p.presence_penalty:
        rows -= p.presence_penalty * (counts > 0).float()
    return rows


def loop_penalized_rows(logits: torch.Tensor, seqs: list[Sequence], n: int,
                        drafts: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """The per-request penalties loop as it was (baseline)."""
    return {i: loop_apply_penalties(logits[i * n : (i + 1) * n].to(torch.float32, copy=True), seq,
                                    drafts[i] if drafts is not None else None)
            for i, seq in enumerate(seqs)}


def loop_logprobs(logits: torch.Tensor, tokens: list[int], n: int, num: int) -> list:
    """The logprobs of a step as they were: one log_softmax, gather, top-k and two host copies
    a request (baseline)."""
    out = []
    for i in range(len(tokens) // n):
        logp = torch.log_softmax(logits[i * n : (i + 1) * n].float(), dim=-1)
        chosen = logp.gather(-1, torch.tensor(tokens[i * n : (i + 1) * n], device=logp.device).view(-1, 1))
        vals, ids = torch.topk(logp, num, dim=-1)
        out.append((chosen.tolist(), vals.tolist(), ids.tolist()))
    return out


def time_penalties(logits: torch.Tensor, batch: int, rows: int, iters: int) -> tuple:
    """(loop us, batched us, equal) for presence + frequency + repetition penalties."""
    gen = torch.Generator().manual_seed(0)
    vocab = logits.shape[-1]
    params = SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    seqs = [Sequence(i, torch.randint(0, vocab, (1024,), generator=gen).tolist(), params,
                     output_token_ids=torch.randint(0, vocab, (256,), generator=gen).tolist()) for i in range(batch)]
    drafts = (torch.randint(0, vocab, (batch, rows - 1), generator=gen).to(logits.device) if rows > 1 else None)
    loop_us = time_call(lambda: loop_penalized_rows(logits, seqs, rows, drafts), logits.device, iters)
    batched_us = time_call(lambda: penalized_rows(logits, seqs, rows, drafts), logits.device, iters)
    a, b = loop_penalized_rows(logits, seqs, rows, drafts), penalized_rows(logits, seqs, rows, drafts)
    same = sum(bool(torch.allclose(a[i], b[i], rtol=1e-6, atol=1e-5)) for i in range(batch))
    return loop_us, batched_us, same


def time_logprobs(logits: torch.Tensor, batch: int, rows: int, iters: int, num: int = 5) -> tuple:
    """(loop us, batched us, rows) for the logprobs of a step, ``num`` a token."""
    tokens = logits.float().argmax(-1).tolist()
    loop_us = time_call(lambda: loop_logprobs(logits, tokens, rows, num), logits.device, iters)
    batched_us = time_call(lambda: top_logprobs(logits, torch.tensor(tokens), num), logits.device, iters)
    return loop_us, batched_us, len(tokens)


def time_call(fn, device: torch.device, iters: int) -> float:
    """Median wall microseconds of ``fn()`` with the device synchronised after each call."""
    times = []
    for _ in range(iters + 2):  # two warm-up calls
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times[2:])


def time_cell(logits: torch.Tensor, batch: int, rows: int, mode: str, iters: int) -> tuple:
    """(loop us, batched us, rows picking the same token) for one batch x rows x mode."""
    params = [SamplingParams(**MODES[mode], seed=i if mode == "seeded" else None) for i in range(batch)]
    seeded = mode == "seeded"
    device = logits.device

    def gens() -> list[torch.Generator | None]:
        return [torch.Generator(device.type).manual_seed(i) if seeded else None for i in range(batch)]

    def states() -> dict[int, list] | None:  # a verify (rows > 1) records the seeded states
        return {i: [] for i in range(batch)} if seeded and rows > 1 else None

    positions = [17 * i for i in range(batch)]  # each request's output position (seeded noise)
    loop_us = time_call(lambda: loop_sample_rows(logits, params, gens(), rows, states()), device, iters)
    batched_us = time_call(lambda: sample_rows(logits, params, positions, rows), device, iters)
    a = loop_sample_rows(logits, params, gens(), rows, states(), positions if seeded else None)
    b = sample_rows(logits, params, positions, rows)
    if mode == "greedy" and not torch.equal(a, b):
        raise AssertionError("greedy rows differ between the loop and the batch")
    return loop_us, batched_us, int((a == b).sum())


def run(args: argparse.Namespace) -> list[tuple]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    results = []
    for what in args.what:
        print(f"\n{what}: per-request loop vs batched; V = {args.vocab}, {args.dtype}, {args.device}")
        print("| batch | rows | mode | loop us | batched us | speedup | same picks / rows |\n"
              "|---:|---:|---|---:|---:|---:|---:|")
        for batch in args.batches:
            for rows in args.rows:
                logits = torch.randn(batch * rows, args.vocab, device=device).mul_(3).to(dtype)
                if what == "sampling":
                    cells = [(mode, time_cell(logits, batch, rows, mode, args.iters)) for mode in args.modes]
                elif what == "penalties":
                    cells = [("pres+freq+rep", time_penalties(logits, batch, rows, args.iters))]
                else:
                    cells = [("5 a token", time_logprobs(logits, batch, rows, args.iters))]
                for mode, (loop_us, batched_us, same) in cells:
                    results.append((what, batch, rows, mode, loop_us, batched_us, same))
                    print(f"| {batch} | {rows} | {mode} | {loop_us:.0f} | {batched_us:.0f} | "
                          f"{loop_us / batched_us:.2f}x | {same} |", flush=True)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--vocab", type=int, default=100352)
    parser.add_argument("--batches", default="1,16,64", help="requests a call, comma separated")
    parser.add_argument("--rows", default="1,4", help="rows a request (1: decode; K + 1: verify)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma separated: {', '.join(MODES)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--what", default="sampling,penalties,logprobs",
                        help="comma separated: sampling, penalties, logprobs")
    args = parser.parse_args(argv)
    for flag in ("batches", "rows"):
        try:
            values = [int(v) for v in getattr(args, flag).split(",")]
        except ValueError:
            parser.error(f"--{flag}: expected comma-separated integers, got {getattr(args, flag)!r}")
        if min(values) < 1:
            parser.error(f"--{flag}: every value must be >= 1")
        setattr(args, flag, values)
    args.what = args.what.split(",")
    if any(w not in ("sampling", "penalties", "logprobs") for w in args.what):
        parser.error(f"--what: {args.what!r}; choose from sampling, penalties, logprobs")
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
