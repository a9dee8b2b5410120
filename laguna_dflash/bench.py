"""``laguna-dflash bench``: the same prompts with and without speculation, in one run.

Both engines load the same target; the speculative one adds the drafter. Each prompt set is run
once as warm-up and then timed. Reported: decode tokens/s of each, their ratio, the mean
acceptance length (``1 + accepted / drafts``) and the per-position acceptance rate.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .config import SamplingParams
from .llm import LLM, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchResult:
    num_prompts: int
    num_tokens: int
    target_only_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    mean_acceptance_length: float
    per_position_acceptance_rate: list[float]
    outputs_identical: bool
    num_speculative_tokens: int
    #: ``--simulate-acceptance-length``: drafts accepted blindly at this mean (else None)
    simulate_acceptance_length: float | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def load_prompts(path: str | Path) -> list[str | dict]:
    """A prompt file (``--prompts``): a JSON list, or JSON Lines, of prompts, each a string,
    ``{"prompt": string}`` or ``{"prompt_token_ids": [int, ...]}`` (vLLM's spellings; token ids
    need no tokenizer in the model). A ValueError naming the file (and line) otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts {path}: not UTF-8 text ({e}); pass a JSON list or JSON Lines "
                         "file of prompts") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list):
        prompts = [_prompt(item, f"{path}[{i}]") for i, item in enumerate(data)]
    else:
        prompts = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {path}:{i + 1} is not JSON; use a JSON list or JSON Lines "
                                 "of prompts") from e
            prompts.append(_prompt(item, f"{path}:{i + 1}"))
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompts")
    return prompts


def _prompt(item: object, where: str) -> str | dict:
    """One prompt-file entry: a non-empty string, ``{"prompt": string}`` or
    ``{"prompt_token_ids": [int, ...]}`` (returned as it is, for ``LLM.generate``)."""
    expected = 'a string, {"prompt": "..."} or {"prompt_token_ids": [int, ...]}'
    if isinstance(item, dict) and "prompt_token_ids" in item:
        ids = item["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) for t in ids)):
            raise ValueError(f'--prompts {where}: "prompt_token_ids" must be a non-empty list of '
                             f"token ids (ints), got {ids!r:.80}")
        return {"prompt_token_ids": ids}
    text = item.get("prompt") if isinstance(item, dict) else item
    if not isinstance(text, str):
        got = f"an object with keys {sorted(item)}" if isinstance(item, dict) else f"{item!r:.80}"
        raise ValueError(f"--prompts {where}: each prompt must be {expected}, got {got}")
    if not text:
        raise ValueError(f"--prompts {where}: the prompt is empty; give it at least one character")
    return text


def timed_generate(llm: LLM, **generate_kwargs) -> tuple[list[RequestOutput], float]:
    """``llm.generate(**generate_kwargs)`` -> (its outputs, the decode seconds it added to the
    engine's counters: prefill excluded)."""
    before = llm.engine.timings.decode_s
    outs = llm.generate(**generate_kwargs)
    return outs, llm.engine.timings.decode_s - before


def _timed_batches(llm: LLM, prompts: list[str | dict], params: SamplingParams, batch_size: int):
    """:func:`timed_generate` over ``prompts`` in batches of ``batch_size``."""
    outs, t_decode = [], 0.0
    for i in range(0, len(prompts), batch_size):
        batch_outs, t = timed_generate(llm, prompts=prompts[i : i + batch_size], sampling_params=params)
        outs += batch_outs
        t_decode += t
    return outs, t_decode


def run_bench(model: str, draft: str, prompts: list[str | dict], max_new_tokens: int = 128,
              batch_size: int = 1, num_speculative_tokens: int | None = None,
              adaptive_k: bool = False, draft_tensor_parallel_size: int | None = None,
              draft_quantization: str | None = None, speculative_token_map: str | None = None,
              simulate_acceptance_length: float | None = None,
              num_speculative_tokens_per_batch_size: list | tuple | None = None,
              **engine_options) -> BenchResult:
    """Greedy decode every prompt with and without the drafter; decode time excludes prefill.

    ``simulate_acceptance_length`` (``--simulate-acceptance-length``): the speculative run
    accepts drafts blindly at this mean acceptance length, to time a drafter of that quality
    (its output is then not the target's). ``num_speculative_tokens_per_batch_size`` (vLLM's K
    schedule, from ``--speculative-config``): the speculative run's K by batch size.

    ``engine_options`` go to both ``LLM``s unchanged (``device``, ``dtype``, ``max_model_len``,
    ``block_size``, ``num_kv_blocks``, ``attention_backend``, ``enforce_eager``, ``load_format``,
    ``batch_invariant``),
    so the two runs differ only in the drafter.
    """
    if not prompts:
        raise ValueError("run_bench needs at least one prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (--batch-size), got {batch_size}")
    if max_new_tokens < 2:  # the first token comes from the prefill: no decode step to time
        raise ValueError(f"max_new_tokens must be >= 2 to time decoding (--max-new-tokens), got {max_new_tokens}")
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    base = LLM(model, **engine_options)
    spec = LLM(model, draft=draft, **engine_options,
               num_speculative_tokens=num_speculative_tokens, adaptive_k=adaptive_k,
               draft_tensor_parallel_size=draft_tensor_parallel_size, draft_quantization=draft_quantization,
               speculative_token_map=speculative_token_map,
               simulate_acceptance_length=simulate_acceptance_length,
               num_speculative_tokens_per_batch_size=num_speculative_tokens_per_batch_size)
    warm = prompts[: min(2, len(prompts))]
    _timed_batches(base, warm, params, batch_size)
    _timed_batches(spec, warm, params, batch_size)
    stats_before = dict(spec.get_metrics())
    base_outs, t_base = _timed_batches(base, prompts, params, batch_size)
    spec_outs, t_spec = _timed_batches(spec, prompts, params, batch_size)
    after = spec.get_metrics()
    drafts = after["num_drafts"] - stats_before["num_drafts"]
    accepted = after["num_accepted_tokens"] - stats_before["num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"],
                                     stats_before["num_accepted_tokens_per_pos"])]
    # decode tokens exclude the first token of each request (it comes from the prefill)
    num_tokens = sum(len(o.token_ids) - 1 for o in base_outs)
    return BenchResult(
        num_prompts=len(prompts), num_tokens=num_tokens,
        target_only_tokens_per_s=num_tokens / t_base, spec_tokens_per_s=num_tokens / t_spec,
        speedup=t_base / t_spec, mean_acceptance_length=1 + accepted / max(drafts, 1),
        per_position_acceptance_rate=[c / max(drafts, 1) for c in per_pos],
        outputs_identical=[o.token_ids for o in base_outs] == [o.token_ids for o in spec_outs],
        num_speculative_tokens=spec.engine.num_speculative_tokens,
        simulate_acceptance_length=simulate_acceptance_length,
    )


def format_result(r: BenchResult) -> str:
    rates = ", ".join(f"{x:.3f}" for x in r.per_position_acceptance_rate)
    return "\n".join([
        f"prompts {r.num_prompts}, decode tokens {r.num_tokens}, K={r.num_speculative_tokens}",
        f"{'mode':<14}{'tokens/s':>10}",
        f"{'target-only':<14}{r.target_only_tokens_per_s:>10.1f}",
        f"{'dflash':<14}{r.spec_tokens_per_s:>10.1f}",
        f"speedup {r.speedup:.2f}x, mean acceptance length {r.mean_acceptance_length:.2f}, "
        f"outputs identical: {r.outputs_identical}",
        f"per-position acceptance rate: {rates}",
    ] + ([f"simulated acceptance (--simulate-acceptance-length {r.simulate_acceptance_length}): "
          "drafts accepted blindly, the dflash output is not the target's"]
         if r.simulate_acceptance_length is not None else []))


def save_acceptance_plot(r: BenchResult, path: str | Path) -> None:
    """Bar chart of the per-position acceptance rate (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from e
    fig, ax = plt.subplots(figsize=(7, 3.5))
    positions = list(range(1, len(r.per_position_acceptance_rate) + 1))
    ax.bar(positions, r.per_position_acceptance_rate, color="#3b7dd8")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"DFlash per-position acceptance (mean acceptance length {r.mean_acceptance_length:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
