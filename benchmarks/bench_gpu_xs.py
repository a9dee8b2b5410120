"""Laguna-XS-2.1-size decode on one GPU: ceilings, the floor, target-only and DFlash steps.

Dummy weights at the real shapes (reference/laguna.md sections 2, 4.1; ``load_format="dummy"``),
bf16, a 1k-token context, the engine's defaults (CUDA graphs, Triton attention and MoE, fused
elementwise chains). Prints, from one run:

* the device-to-device copy bandwidth and the bf16 GEMM rate, measured here;
* the bandwidth floor of a batch-1 decode step (bytes of the active parameters plus the KV read,
  over the measured bandwidth), the target-only decode step, and DFlash steps at K = 1, 3, 7, 15
  (random drafter, acceptance forced to 1, so every step costs the same) split into context
  precompute, drafter block and target verify;
* with ``--variants``: the batch-1 decode step with CUDA graphs / eager, fused / unfused
  elementwise chains, Triton / torch SDPA attention, fused Triton / grouped_mm MoE;
* with ``--profile``: kernels per eager decode step, fused and unfused;
* tokens/s at simulated acceptance lengths (SGLang's SIMULATE_ACC_LEN: drafts accepted without
  checking) against target-only at batch 1, 4, 16, 64, best K per cell (K = 0 is no drafting):
  the tokens delivered over decode time (``token_time``; a request's last step keeps only the
  tokens up to ``--new-tokens``, so at 64 new tokens and L = 4 the rate is 63 tokens over 16
  steps; with 65 every step delivers L).
* a digest of the batch-1 greedy tokens of target-only and of the longest simulated cell, to
  compare between processes (their routing is the same exactly when their tokens are).

    python benchmarks/bench_gpu_xs.py --new-tokens 32 --variants --profile   # H200
    python benchmarks/bench_gpu_xs.py --device cpu --layers 2 --hidden 256 --context 64 \
        --batches 1,4 --ks 1,3 --simulated 1,4                               # CPU wiring check
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import tempfile
import time
from pathlib import Path

import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import DRAFT_QUANTIZATIONS
from laguna_dflash.engine import engine as engine_module
from laguna_dflash.engine.adaptive_k import AdaptiveK
from laguna_dflash.engine.attention import get_attention_backend
from laguna_dflash.models import fusion
from laguna_dflash.models.draft_vocab import save_token_map
from laguna_dflash.models.layers import MoE


def xs_target_config(num_layers: int) -> dict:
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    return {
        "architectures": ["LagunaForCausalLM"], "model_type": "laguna", "vocab_size": 100352,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": num_layers,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
        "num_attention_heads_per_layer": [48 if t == "full_attention" else 64 for t in types],
        "layer_types": types, "sliding_window": 512, "gating": "per-head",
        "mlp_layer_types": ["dense"] + ["sparse"] * (num_layers - 1), "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "moe_routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                               "original_max_position_embeddings": 8192, "beta_fast": 64.0,
                               "beta_slow": 1.0, "partial_rotary_factor": 0.5,
                               "attention_factor": 1.3465735902799727},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
        "eos_token_id": [2, 24],
    }


def xs_draft_config(num_target_layers: int) -> dict:
    taps = [t for t in (1, 13, 25, 33, 39) if t < num_target_layers] or [0]
    return {
        "architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 5, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "max_position_embeddings": 262144, "sliding_window": 512,
        "layer_types": ["sliding_attention"] * 5, "gating": "per-head", "num_experts": 0,
        "vocab_size": 100352, "draft_vocab_size": 100352,
        "dflash_config": {"block_size": 16, "mask_token_id": 12, "num_target_layers": num_target_layers,
                          "target_layer_ids": taps, "causal": True},
    }


def add_xs_pair_args(ap: argparse.ArgumentParser, new_tokens: int, rounds: int,
                     new_tokens_help: str) -> None:
    """The options of the one-process A/B scripts on the XS-2.1 pair (bench_taps.py,
    bench_adaptive_ab.py): rounds, context, tokens a run, layers, the CPU wiring check's width
    and the device."""
    ap.add_argument("--rounds", type=int, default=rounds, help="timed rounds after the warm-up round")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=new_tokens, help=new_tokens_help)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU wiring check")
    ap.add_argument("--device", default="cuda")


def xs_pair_llm(args: argparse.Namespace, directory: Path, max_model_len: int, max_num_seqs: int,
                **options) -> tuple[LLM, dict]:
    """The XS-2.1 pair of the one-process A/B scripts (:func:`add_xs_pair_args`), dummy weights:
    bf16 on CUDA, float32 for the CPU wiring check; KV blocks for ``max_num_seqs + 1`` requests
    of ``max_model_len + 64`` tokens. ``options`` go to ``LLM``. -> (LLM with the drafter,
    the target config)."""
    tdir, ddir, tcfg = write_xs_configs(directory, args.layers, args.hidden)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    options.setdefault("cuda_graph_capture", "lazy")  # the timed runs are warmed: start-up capture only costs device time
    options.setdefault("num_kv_blocks", (max_model_len + 64) // 16 * (max_num_seqs + 1))
    llm = LLM(str(tdir), draft=str(ddir), dtype=dtype, device=args.device, load_format="dummy",
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, **options)
    return llm, tcfg


def write_xs_configs(directory: Path, num_layers: int, hidden: int = 2048) -> tuple[Path, Path, dict]:
    """Write the XS-2.1-shaped target and drafter ``config.json`` under ``directory/target`` and
    ``directory/draft`` (for ``load_format="dummy"``) -> (target dir, drafter dir, target config).
    ``hidden`` other than 2048 is a CPU wiring check: every width shrinks with it, 16 experts,
    a 4096-token vocabulary, the same structure."""
    tdir, ddir = directory / "target", directory / "draft"
    tdir.mkdir()
    ddir.mkdir()
    tcfg, dcfg = xs_target_config(num_layers), xs_draft_config(num_layers)
    if hidden != 2048:
        f = hidden / 2048
        for c in (tcfg, dcfg):
            c.update(hidden_size=hidden, intermediate_size=int(8192 * f), vocab_size=4096)
        dcfg["draft_vocab_size"] = 4096
        tcfg.update(num_experts=16, moe_intermediate_size=int(512 * f),
                    shared_expert_intermediate_size=int(512 * f))
    (tdir / "config.json").write_text(json.dumps(tcfg))
    (ddir / "config.json").write_text(json.dumps(dcfg))
    return tdir, ddir, tcfg


def parse_switch(text: str) -> tuple[object, str, object]:
    """``module:attr[.attr]=value`` (value as JSON; True / False accepted) -> (object, attribute
    name, value), e.g. ``laguna_dflash.kernels.pdl:USE_PDL=True``. A JSON object for an attribute
    holding a dataclass instance gives a copy with those fields replaced (its checks run), e.g.
    ``laguna_dflash.kernels.qkv_norm_rope_cache:DEFAULT_CONFIG={"num_warps": 8}``."""
    target, value = text.split("=", 1)
    module, attr = target.split(":")
    obj = importlib.import_module(module)
    *path, name = attr.split(".")
    for p in path:
        obj = getattr(obj, p)
    parsed = json.loads(value.lower() if value in ("True", "False") else value)
    current = getattr(obj, name, None)
    if isinstance(parsed, dict) and dataclasses.is_dataclass(current) and not isinstance(current, type):
        try:
            parsed = dataclasses.replace(current, **parsed)
        except TypeError as e:  # an unknown field
            raise ValueError(f"{type(current).__name__} fields are "
                             f"{[f.name for f in dataclasses.fields(current)]}: {e}") from None
    return obj, name, parsed


def switch_error(text: str) -> str | None:
    """Why ``text`` is not a ``module:attr=value`` switch of an existing attribute (its module
    imported now, before any timing), or None when it is one."""
    try:
        obj, name, _ = parse_switch(text)
        getattr(obj, name)
    except (ValueError, ImportError, AttributeError) as e:
        return f"{text!r}: {e}; use module:attr=value"
    return None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - t0)  # read + write


def gemm_tflops(device: str, n: int = 8192) -> float:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def active_bytes(model, context: int) -> int:
    """Bytes a batch-1 decode step must read: all non-expert weights except the embedding table,
    top_k of E experts per MoE layer, and the visible KV (full layers: context; SWA: window)."""
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name.startswith("embed_tokens"):
            continue
        if "experts_" in name:
            moe = model.spec.moe
            n = n * moe.top_k // moe.num_experts
        total += n
    s = model.spec
    per_token = 2 * s.num_kv_heads * s.head_dim * 2
    for layer in s.layers:
        total += per_token * (min(context, layer.sliding_window) if layer.sliding_window else context)
    return total


def batch_prompts(prompt: list[int], batch: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``prompt``'s length and tokens: row ``i`` is ``prompt``
    rotated by ``37 i`` positions. Copies of one prompt would decode the same greedy tokens in
    every row, so each MoE layer would read 9 experts for the whole batch instead of up to 9
    a row (and prefix caching would compute the prompt once): a cheaper step than real
    traffic. Until 2026-12-01 the batch > 1 cells used copies."""
    return [prompt[(37 * i) % len(prompt):] + prompt[: (37 * i) % len(prompt)] for i in range(batch)]


def decode_run(llm: LLM, prompt: list[int], new_tokens: int, batch: int = 1, warm: bool = False) -> dict:
    """One greedy run of ``batch`` prompts (:func:`batch_prompts`), ``new_tokens`` each -> the
    engine metrics it added: ``num_decode_steps``, ``num_decode_tokens`` (the tokens delivered),
    ``decode_s``. ``warm``: one untimed run of the same shapes first (CUDA graphs captured)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    if warm:
        llm.generate(prompt_token_ids=batch_prompts(prompt, batch), sampling_params=params)
    before = llm.get_metrics()
    llm.generate(prompt_token_ids=batch_prompts(prompt, batch), sampling_params=params)
    sync(llm.config.device)
    after = llm.get_metrics()
    return {key: after[key] - before[key] for key in ("num_decode_steps", "num_decode_tokens", "decode_s")}


def step_time(llm: LLM, prompt: list[int], new_tokens: int, batch: int = 1, warm: bool = True) -> float:
    """Mean seconds per decode (or DFlash) step of ``batch`` prompts (:func:`batch_prompts`); the warm-up
    run has the same shapes, so CUDA graphs are captured before timing."""
    run = decode_run(llm, prompt, new_tokens, batch, warm)
    return run["decode_s"] / run["num_decode_steps"]


def token_time(llm: LLM, prompt: list[int], new_tokens: int, batch: int = 1, warm: bool = True) -> float:
    """Mean decode seconds per token each of ``batch`` prompts (:func:`batch_prompts`) is
    delivered: decode wall time over the tokens committed (``num_decode_tokens`` / ``batch``).
    Not a step time over the tokens a step should give: a request's last DFlash step keeps only
    the tokens up to ``max_tokens`` (64 new tokens at acceptance length 4 are 16 steps for 63
    decode tokens: a step time / 4 overstated the rate by 64 / 63, sixty-third pass). The warm-up
    run has the same shapes."""
    run = decode_run(llm, prompt, new_tokens, batch, warm)
    return batch * run["decode_s"] / run["num_decode_tokens"]


def prefill_time(llm: LLM, prompt: list[int], batch: int, warm: bool = False) -> float:
    """Seconds of the prefill step of ``batch`` prompts (:func:`batch_prompts`; one token generated: no
    decode step); with a drafter it includes the prompts' drafter context store. The whole
    prompt is computed: the prefix cache is emptied first. ``warm``: one untimed prefill first
    (a shape's first prefill pays its first-use costs: a graph capture or a compile; a one-round
    run read 485 ms for a 50 ms step without it, 2026-12-02)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if warm:
        prefill_time(llm, prompt, batch)
    llm.reset_prefix_cache()
    before = llm.get_metrics()
    llm.generate(prompt_token_ids=batch_prompts(prompt, batch), sampling_params=params)
    return llm.get_metrics()["prefill_s"] - before["prefill_s"]


def decode_tokens_per_s(llm: LLM, prompt: list[int], new_tokens: int, batch: int) -> float:
    """Decode-phase tokens per second of ``batch`` prompts (:func:`batch_prompts`; committed tokens over
    decode wall time: what a speculating engine delivers)."""
    run = decode_run(llm, prompt, new_tokens, batch)
    return run["num_decode_tokens"] / run["decode_s"]


def tokens_digest(llm: LLM, prompt: list[int], new_tokens: int) -> str:
    """The first 12 hex digits of a SHA-1 over the greedy token ids of one batch-1 run: the
    same in every process exactly when the runs generated the same tokens (and so routed the
    same way; dummy weights and the prompt are seeded)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    return hashlib.sha1(json.dumps(list(out.outputs[0].token_ids)).encode()).hexdigest()[:12]


def graph_runners(llm: LLM) -> list:
    engine = llm.engine
    return [engine.runner] + ([engine.proposer.runner] if engine.proposer is not None else [])


def set_graphs(llm: LLM, saved: list | None) -> list:
    """Detach (``saved=None``) or restore the CUDA-graph runners; captured graphs are dropped
    either way, so the next run recaptures with the current fusion setting."""
    runners = graph_runners(llm)
    current = [r.graphs for r in runners]
    for r, g in zip(runners, saved if saved is not None else [None] * len(runners)):
        r.graphs = g
    for g in current + (saved or []):
        if g is not None:
            g.reset()
    return current


def time_variants(llm: LLM, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """Batch-1 target-only decode step: CUDA graphs vs eager, fused elementwise chains or not,
    Triton vs torch SDPA attention, fused vs grouped-GEMM MoE (same weights; the engine's
    default is the first row)."""
    engine, out = llm.engine, {}
    default_backend = engine.backend
    rows = [("cuda graphs", True, "triton", True), ("cuda graphs", False, "triton", True),
            ("cuda graphs", True, "triton", False), ("eager", True, "triton", True),
            ("eager", False, "triton", True), ("eager", False, "torch_sdpa", True)]
    for mode, fuse, backend, fused_moe in rows:
        saved = set_graphs(llm, None) if mode == "eager" else None
        fusion.enabled, MoE.use_fused_moe = fuse, fused_moe
        for r in graph_runners(llm):
            if r.graphs is not None:
                r.graphs.reset()
        engine.backend = engine.runner.backend = get_attention_backend(backend)
        name = (f"{mode}, {'fused' if fuse else 'unfused'} elementwise, {backend} attention, "
                f"{'fused Triton' if fused_moe else 'grouped_mm'} MoE")
        out[name] = step_time(llm, prompt, new_tokens)
        if saved is not None:
            set_graphs(llm, saved)
        engine.backend = engine.runner.backend = default_backend
    fusion.enabled, MoE.use_fused_moe = True, True
    for r in graph_runners(llm):
        if r.graphs is not None:
            r.graphs.reset()
    return out


def count_kernels(llm: LLM, prompt: list[int], new_tokens: int = 8
                  ) -> tuple[dict[str, tuple[float, float]], list[tuple[str, float, float]]]:
    """Per batch-1 decode step, run eagerly: (kernels launched, summed kernel ms), with the
    elementwise chains fused and not, and the fused step's kernels by name (count, ms per
    step), largest first. Each kernel is one node of the step's CUDA graph. Two generations that
    differ by ``new_tokens`` decode steps are profiled; the difference is divided by
    ``new_tokens`` (prefill cancels)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    def kernels_of(max_tokens: int) -> tuple[Counter, Counter]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=[prompt[:64]], sampling_params=params)
        sync("cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt_token_ids=[prompt[:64]], sampling_params=params)
            sync("cuda")
        counts, times = Counter(), Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                counts[e.name[:70]] += 1
                times[e.name[:70]] += e.device_time / 1e3
        return counts, times

    saved, out, by_name = set_graphs(llm, None), {}, []
    for fuse in (True, False):
        fusion.enabled = fuse
        (c1, t1), (c2, t2) = kernels_of(2), kernels_of(2 + new_tokens)
        c2.subtract(c1)
        t2.subtract(t1)
        out["fused" if fuse else "unfused"] = (sum(c2.values()) / new_tokens, sum(t2.values()) / new_tokens)
        if fuse:
            by_name = sorted(((n, c2[n] / new_tokens, t2[n] / new_tokens) for n in c2), key=lambda r: -r[2])
    fusion.enabled = True
    set_graphs(llm, saved)
    return out, by_name


class PhaseClock:
    """Records synchronised wall times of the drafter's context precompute, the drafter block
    forward and the target's decode-phase forward (benchmark only: it syncs). Reported as the
    median per call.

    A context store of more than ``K_max + 1`` rows for some request is the prompt's (prefill
    without its own store, or a recompute) and is recorded as "prompt context", apart: with the
    verify graph storing each step's context there may be no per-step store at all, and the
    median of the prompt stores alone once passed for a per-step cost (the seventh pass's and
    the eighth pass's first tables). A call with nothing pending is not recorded.

    The syncs serialise host and GPU, which undoes the work each step queues ahead of its host
    sync (drafts, forwards): step times must be taken with the clock removed (a context
    manager: ``with PhaseClock(llm) as clock:`` wraps, leaving the block unwraps)."""

    def __init__(self, llm: LLM, device: str = "cuda") -> None:
        self.times: dict[str, list[float]] = {}
        self._saved: list[tuple[object, str]] = []
        self.device = device
        engine = llm.engine
        max_step_rows = engine.proposer.num_speculative_tokens + 1  # K_max + 1 (engine._decode)

        def context_phase(seqs, *args, **kwargs) -> str | None:
            rows = [s.num_pending for s in seqs if s.num_pending]
            if not rows:
                return None
            return "context precompute" if max(rows) <= max_step_rows else "prompt context"

        self._wrap(engine.proposer, "store_context", context_phase)
        for runner, name in ((engine.proposer.runner, "drafter block"), (engine.runner, "target forward")):
            if runner.graphs is not None:
                self._wrap(runner.graphs, "forward", lambda *a, _name=name, **k: _name)

    def __enter__(self) -> PhaseClock:
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr in self._saved:
            delattr(obj, attr)  # the instance attribute shadowed the method: the method is back

    def _wrap(self, obj, attr: str, phase_of) -> None:
        # phase_of(*args, **kwargs): the phase a call is recorded under, or None (not recorded)
        fn = getattr(obj, attr)
        self._saved.append((obj, attr))

        def timed(*args, **kwargs):
            name = phase_of(*args, **kwargs)  # before the call: it clears the pending taps
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            if name is not None:
                self.times.setdefault(name, []).append(time.perf_counter() - t0)
            return out

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.times.clear()

    def median_ms(self, name: str) -> float | None:
        """Median of the phase's recorded calls in ms, None when it never ran."""
        times = sorted(self.times.get(name, []))
        return 1e3 * times[len(times) // 2] if times else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--batches", default="1,4,16,64", help="batch sizes to time")
    ap.add_argument("--ks", default="1,3,7,15", help="draft counts K for the batch-1 DFlash step")
    ap.add_argument("--simulated", default="1,2,4,8", help="simulated acceptance lengths to time")
    ap.add_argument("--sim-ks", default="0,1,3,7", help="K values tried per simulated-acceptance cell")
    ap.add_argument("--every-k", action="store_true",
                    help="try every --sim-ks value in every cell; by default K > 0 only where K + 1 >= L "
                         "(a drafter of acceptance L accepts all K < L drafts: 1 + K tokens a step)")
    ap.add_argument("--adaptive", action="store_true",
                    help="also time the adaptive-K engine per simulated-acceptance cell")
    ap.add_argument("--rounds", type=int, default=2,
                    help="interleaved repeats of the target-only and simulated cells (min kept)")
    ap.add_argument("--device", default="cuda", help="cpu runs a wiring check at small sizes")
    ap.add_argument("--hidden", type=int, default=2048, help="override only for a CPU wiring check")
    ap.add_argument("--attention-backend", default="auto", help="auto | torch_sdpa | triton")
    ap.add_argument("--variants", action="store_true",
                    help="also time batch-1 target-only decode per attention backend x MoE path")
    ap.add_argument("--profile", action="store_true",
                    help="count the kernels (graph nodes) of an eager batch-1 decode step")
    ap.add_argument("--progress", action="store_true",
                    help="print each simulated-acceptance cell as it is timed (a run cut short keeps them)")
    ap.add_argument("--switch", action="append", default=[],
                    help="module:attr=value set for the whole run before the engine is built "
                         "(repeatable), e.g. laguna_dflash.kernels.pdl:USE_PDL=True")
    ap.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default=None,
                    help="the drafter's o_proj, MLP and lm_head copy in fp8 (models/fp8.py); "
                         "target-only is the same either way")
    ap.add_argument("--token-map-size", type=int, default=None, metavar="N",
                    help="draft among N token ids only (--speculative-token-map; a seeded random N "
                         "of the vocabulary: the drafts of random weights mean nothing, the lm_head "
                         "rows read are what is timed); default: the whole vocabulary")
    args = ap.parse_args()
    for text in args.switch:
        obj, name, value = parse_switch(text)
        setattr(obj, name, value)
    cpu = not args.device.startswith("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth(args.device, 64 << 20 if cpu else 4 << 30)
    tflops = gemm_tflops(args.device, 512 if cpu else 8192)
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir, tcfg = write_xs_configs(Path(tmp), args.layers, args.hidden)
        max_batch = max(batches)
        common = dict(dtype="float32" if cpu else "bfloat16", device=args.device, load_format="dummy",
                      attention_backend=args.attention_backend,
                      max_model_len=args.context + 256, max_num_seqs=max_batch,
                      num_kv_blocks=(args.context + 320) // 16 * (max_batch + 1),
                      cuda_graph_capture="lazy")  # every timed cell runs warm first
        t0 = time.perf_counter()
        token_map = None
        if args.token_map_size is not None:
            ids = torch.randperm(tcfg["vocab_size"], generator=torch.Generator().manual_seed(0))
            token_map = str(save_token_map(ids[: args.token_map_size], Path(tmp) / "token_map.pt"))
        spec = LLM(str(tdir), draft=str(ddir), draft_quantization=args.draft_quantization,
                   speculative_token_map=token_map, **common)
        load_s = time.perf_counter() - t0
        prompt = torch.randint(100, tcfg["vocab_size"] - 1, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        floor = active_bytes(spec.engine.target, args.context) / bw
        engine = spec.engine
        max_k = engine.num_speculative_tokens
        # DFlash step (draft K tokens + verify K+1) at batch 1, random drafter; acceptance is
        # forced to 1 (no drafts kept) so every step costs the same
        k_steps, phases = {}, {}
        engine.simulated_acceptance, engine._sim_carry = 1.0, 0.0

        def time_k(label) -> None:
            # the step time without the clock's syncs, then (GPU) its phases in a run with them
            step_time(spec, prompt, args.new_tokens)  # warm-up: capture this K's graphs
            k_steps[label] = step_time(spec, prompt, args.new_tokens, warm=False)
            if not cpu:
                with PhaseClock(spec) as clock:
                    step_time(spec, prompt, args.new_tokens, warm=False)
                    phases[label] = {n: clock.median_ms(n) for n in
                                     ("context precompute", "drafter block", "target forward")}

        # DFlash step (draft K tokens + verify K+1) at batch 1, random drafter; acceptance is
        # forced to 1 (no drafts kept) so every step costs the same
        for k in (int(x) for x in args.ks.split(",")):
            engine.num_speculative_tokens = min(k, max_k)
            time_k(k)
        # the same step with the drafter's context stored by the next step (its context graph)
        # instead of by the verify graph, and so without the drafts queued ahead
        if 3 in k_steps:
            engine.num_speculative_tokens = min(3, max_k)
            engine_module.store_context_in_verify = False
            time_k("3, context after verify")
            engine_module.store_context_in_verify = True
        # Simulated acceptance against target-only, interleaved per batch size and repeated
        # (--rounds; the minimum per cell is kept): this host's step times drift by 10-15%
        # between minutes, more than the K = 0 overhead being measured.
        simulated = {}  # (batch, length) -> (seconds per token per request, K)
        base = {}  # batch -> seconds per target-only step
        prefill = {}  # (batch, with the drafter's context store) -> seconds per prefill step
        sim_ks = [int(x) for x in args.sim_ks.split(",")]
        proposer = engine.proposer
        for b in batches:
            for rnd in range(args.rounds):
                # target-only on the same weights (two 67 GB copies would not fit): detach the proposer
                engine.proposer, engine.tap_layer_ids = None, ()
                engine.simulated_acceptance = None
                t = step_time(spec, prompt, args.new_tokens, b, warm=rnd == 0)
                base[b] = min(t, base.get(b, t))
                t = prefill_time(spec, prompt, b, warm=rnd == 0)
                prefill[b, False] = min(t, prefill.get((b, False), t))
                engine.proposer, engine.tap_layer_ids = proposer, tuple(engine.drafter.target_layer_ids)
                t = prefill_time(spec, prompt, b, warm=rnd == 0)
                prefill[b, True] = min(t, prefill.get((b, True), t))
                for length in (float(x) for x in args.simulated.split(",")):
                    # K = 0 (no drafting: the target decodes, the drafter's context still kept)
                    # is always a candidate; K > 0 only where K + 1 >= L unless --every-k
                    for k in (k for k in sim_ks if (k == 0 or k + 1 >= length or args.every_k) and k <= max_k):
                        engine.num_speculative_tokens = k
                        engine.simulated_acceptance, engine._sim_carry = length, 0.0
                        # the tokens delivered, not the bonus plus min(K, L - 1) a step: a request's
                        # last step keeps only those up to max_tokens (token_time)
                        t = token_time(spec, prompt, args.new_tokens, b, warm=rnd == 0)
                        if (b, length) not in simulated or t < simulated[b, length][0]:
                            simulated[b, length] = (t, k)
                        if args.progress:
                            print(f"(round {rnd}: batch {b}, L = {length:g}, K = {k}: {1e3 * t:.4f} ms a token "
                                  f"a request; target-only {1e3 * base[b]:.4f} ms)", flush=True)
        # The adaptive-K engine (--adaptive-k) per cell: it picks K itself from measured step
        # times and acceptance, exploring the full K now and then. A fresh policy per cell learns
        # in a warm-up run of the same length; graphs for the K values it picks later are
        # captured inside the timed run (pessimistic).
        adaptive = {}  # (batch, length) -> (tok/s, mean K drafted per step)
        if args.adaptive:
            for b in batches:
                for length in (float(x) for x in args.simulated.split(",")):
                    engine.num_speculative_tokens = max_k
                    engine.k_policy = AdaptiveK(max_k)
                    engine.simulated_acceptance, engine._sim_carry = length, 0.0
                    decode_tokens_per_s(spec, prompt, 4 * args.new_tokens, b)  # learn
                    drafted = engine.spec_stats.num_draft_tokens, engine.timings.num_decode_steps
                    rate = decode_tokens_per_s(spec, prompt, 4 * args.new_tokens, b)
                    steps = engine.timings.num_decode_steps - drafted[1]
                    mean_k = (engine.spec_stats.num_draft_tokens - drafted[0]) / max(1, steps) / b
                    adaptive[b, length] = (rate, mean_k)
            engine.k_policy = None
        # the batch-1 tokens of target-only and of the longest simulated cell, as digests: do
        # separate processes generate (and so route) the same? (their step times differ)
        digests = {}
        if 1 in batches and simulated:
            length = max(x for b, x in simulated if b == 1)
            engine.num_speculative_tokens = simulated[1, length][1]
            engine.simulated_acceptance, engine._sim_carry = length, 0.0
            digests[f"L={length:g}, K={simulated[1, length][1]}"] = tokens_digest(spec, prompt, args.new_tokens)
            engine.proposer, engine.tap_layer_ids = None, ()
            engine.simulated_acceptance = None
            digests["target-only"] = tokens_digest(spec, prompt, args.new_tokens)
            engine.proposer, engine.tap_layer_ids = proposer, tuple(engine.drafter.target_layer_ids)
        engine.simulated_acceptance = None
        engine.num_speculative_tokens = max_k
        engine.proposer, engine.tap_layer_ids = None, ()  # target-only for the variants
        variants = time_variants(spec, prompt, args.new_tokens) if args.variants else {}
        kernels, by_name = count_kernels(spec, prompt) if args.profile and not cpu else ({}, [])
        engine.proposer = proposer
    name = torch.cuda.get_device_name() if not cpu else "cpu"
    print(f"device {name}, torch {torch.__version__}, layers {args.layers}, "
          f"context {args.context}, dummy load + warm-up {load_s:.1f}s, attention {engine.backend.name}, "
          f"cuda graphs {engine.runner.graphs is not None}")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 GEMM {tflops:.0f} TFLOP/s"
          + (f", switches: {'; '.join(args.switch)}" if args.switch else "") + "\n")
    print("| batch-1 step | ms | x floor | context precompute ms | drafter block ms | target forward ms |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| bandwidth floor (decode) | {floor * 1e3:.2f} | 1.00 | | | |")
    if 1 in base:
        print(f"| target-only decode | {base[1] * 1e3:.2f} | {base[1] / floor:.2f} | | | |")
    for k, t in k_steps.items():
        ph = phases.get(k, {})
        cells = " | ".join("-" if ph.get(n, 0.0) is None else f"{ph[n]:.2f}" if n in ph else ""
                           for n in ("context precompute", "drafter block", "target forward"))
        label = f"DFlash K={k} (draft {k}, verify {k + 1})" if isinstance(k, int) else f"DFlash K={k}"
        print(f"| {label} | {t * 1e3:.2f} | {t / floor:.2f} | {cells} |")
    if phases:
        print("\n(phases: medians per call in a separate run with syncs around each; context "
              "precompute: the drafter's per-step context store outside the verify graph, \"-\" "
              "where the verify graph stores it)")
    if variants:
        print("\n| batch-1 target-only decode variant | ms | x floor |\n|---|---:|---:|")
        for name, t in variants.items():
            print(f"| {name} | {t * 1e3:.2f} | {t / floor:.2f} |")
    if kernels:
        print("\n| eager batch-1 decode step | kernels | summed kernel ms |")
        print("|---|---:|---:|")
        for name, (n, ms) in kernels.items():
            print(f"| {name} elementwise chains | {n:.0f} | {ms:.2f} |")
        print("\n| kernel (fused step, top 15 by time) | per step | ms per step |\n|---|---:|---:|")
        for name, n, ms in by_name[:15]:
            print(f"| `{name}` | {n:.0f} | {ms:.3f} |")
    lengths = sorted({length for _, length in simulated})
    print("\nsimulated acceptance length L (every step accepts L - 1 drafts on average); best K of "
          f"{args.sim_ks} per cell, shown as tok/s (x target-only, K): tokens delivered over decode time "
          f"({args.new_tokens} new tokens a request, the first from the prefill)")
    print("\n| batch | target-only tok/s | " + " | ".join(f"L={x:g}" for x in lengths) + " |")
    print("|---:|---:|" + "---:|" * len(lengths))
    for b in batches:
        cells = [f"{b / simulated[b, x][0]:.1f} ({base[b] / simulated[b, x][0]:.2f}x, K={simulated[b, x][1]})"
                 for x in lengths]
        print(f"| {b} | {b / base[b]:.1f} | " + " | ".join(cells) + " |")
    if digests:
        print("\nbatch-1 greedy tokens (SHA-1, 12 hex digits): "
              + ", ".join(f"{name} {d}" for name, d in digests.items()))
    print(f"\nprefill step of the {args.context}-token prompt(s), ms (the drafter's context store of "
          "the prompts runs in it)\n\n| batch | target-only | with the drafter | ratio |\n|---:|---:|---:|---:|")
    for b in batches:
        print(f"| {b} | {prefill[b, False] * 1e3:.2f} | {prefill[b, True] * 1e3:.2f} | "
              f"{prefill[b, True] / prefill[b, False]:.2f} |")
    if adaptive:
        print(f"\nthe adaptive-K engine (--adaptive-k, K <= {max_k} chosen per step) at the same "
              "simulated acceptance: tok/s (x target-only, mean K drafted per step)")
        print("\n| batch | " + " | ".join(f"L={x:g}" for x in lengths) + " |")
        print("|---:|" + "---:|" * len(lengths))
        for b in batches:
            cells = [f"{adaptive[b, x][0]:.1f} ({adaptive[b, x][0] * base[b] / b:.2f}x, "
                     f"K={adaptive[b, x][1]:.1f})" for x in lengths]
            print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
