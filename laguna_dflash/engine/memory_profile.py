"""How much GPU memory the KV cache may take.

Three ways, in the engine's order of precedence after ``--num-kv-blocks``:

* ``gpu_memory_utilization`` (vLLM's flag): the weights, the activations of the largest
  forward and sampling step, and the KV cache hold that fraction of the device's memory. The
  activations are measured before the cache exists, by a profile run
  (:func:`activation_peak_bytes`: one eager prefill forward of the scheduler's whole token
  budget, the drafter's context store of it, then the sampler over the largest verify batch),
  as vLLM's profile run does. CUDA graph pools are not counted, as in vLLM: keep some headroom.
* ``mem_fraction_static`` (SGLang's flag): the weights and the KV cache hold that fraction;
  activations come on top.
* neither: :data:`DEFAULT_KV_SHARE_OF_FREE` of the memory free once the weights are loaded.
"""

from __future__ import annotations

import logging

import torch

from ..config import SamplingParams, flag
from .kv_cache import KVCache
from .runner import ForwardItem, ModelRunner
from .sampler import sample_rows

logger = logging.getLogger(__name__)

# With neither fraction set: the KV cache takes this share of the GPU memory free after load.
# The rest holds activations, CUDA graph pools and start-up's transients. At XS-2.1 size on the
# H200 with start-up capture, 0.7 gave a 53.1 GiB cache and torch's peak reserved 130.7 of
# 139.8 GiB while start-up's capture warm-ups left ~10 GiB of cached blocks on dead streams
# (thirty-ninth pass; 0.7 then). With the warm-ups on one stream that peak is 119.8 GiB at 0.7,
# and a 60.3 GiB cache peaks at 127.0 start-up, 128.2 serving (fortieth pass): 0.8 again.
DEFAULT_KV_SHARE_OF_FREE = 0.8


def kv_cache_budget_bytes(free: int, total: int, fraction: float | None,
                          activation_bytes: int = 0, field: str = "mem_fraction_static") -> int:
    """Bytes the KV cache may take on a GPU with ``free`` of ``total`` bytes free once the
    weights are loaded.

    ``fraction`` None: :data:`DEFAULT_KV_SHARE_OF_FREE` of ``free``. Else the memory in use
    (weights, anything else on the device), ``activation_bytes`` (the profiled peak; 0 for
    ``mem_fraction_static``) and the cache hold ``fraction`` of ``total``. ``field`` names the
    setting in errors: a ValueError when that fraction is used up already."""
    if fraction is None:
        return int(free * DEFAULT_KV_SHARE_OF_FREE)
    used = total - free
    budget = int(fraction * total) - used - activation_bytes
    if budget <= 0:
        needed = (used + activation_bytes) / total
        activations = (f" and a forward's activations take {activation_bytes / 2**30:.1f} GiB "
                       "(profiled at --max-num-batched-tokens)" if activation_bytes else "")
        raise ValueError(
            f"{field}={fraction} ({flag(field)}) leaves no memory for the KV cache: "
            f"{used / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB are in use once the "
            f"weights are loaded{activations}; raise it above {needed:.2f}, or set --num-kv-blocks"
            + (", or lower --max-num-batched-tokens" if activation_bytes else ""))
    return budget


def profile_items(num_tokens: int, max_model_len: int, block_size: int) -> list[ForwardItem]:
    """A prefill of ``num_tokens`` tokens as the scheduler could batch it: requests of at most
    ``max_model_len - 1`` prompt tokens each (a prompt leaves room for one output token), each
    from position 0 over its own consecutive blocks (0, 1, ..)."""
    longest = max(1, max_model_len - 1)
    items, next_block = [], 0
    while num_tokens > 0:
        n = min(num_tokens, longest)
        num_blocks = -(-n // block_size)
        items.append(ForwardItem(n, 0, n, list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
        num_tokens -= n
    return items


@torch.inference_mode()
def run_profile_forward(target: torch.nn.Module, drafter: torch.nn.Module | None,
                        runner: ModelRunner, draft_cache: KVCache | None,
                        items: list[ForwardItem], num_sampled_requests: int,
                        rows_per_request: int) -> None:
    """The work whose activations the profile measures, over throwaway caches: the eager
    prefill forward of ``items`` (with a drafter: its taps, gathered and stored as context K/V
    into ``draft_cache``, as a prefill step does), then the logits of ``num_sampled_requests *
    rows_per_request`` rows sampled with a temperature, top-k and top-p (the sampler's largest
    path), and their float32 log-softmax (logprobs)."""
    num_tokens = sum(it.num_tokens for it in items)
    # distinct tokens: a prompt of one repeated token would route every row to the same experts
    ids = torch.arange(num_tokens, device=runner.device) * 7919 % target.spec.vocab_size
    tap_layer_ids = tuple(drafter.target_layer_ids) if drafter is not None else ()
    hidden, taps = runner.forward(ids, items, tap_layer_ids)
    if drafter is not None:
        # as a prefill step stores them (DFlashProposer.store_context, eager): the taps held
        # while their rows are gathered into one more copy, then projected and written
        meta = runner.context(items).meta
        rows = taps[torch.arange(num_tokens, device=taps.device)]
        drafter.precompute_and_store_context_kv(drafter.combine_hidden_states(rows), meta.positions,
                                                meta.slot_mapping, draft_cache.layers)
        del taps, rows
    rows = num_sampled_requests * rows_per_request
    index = torch.arange(rows, device=hidden.device) % hidden.shape[0]
    logits = target.lm_head_logits(hidden[index])
    del hidden
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    sample_rows(logits, [params] * num_sampled_requests, rows_per_request=rows_per_request)
    torch.log_softmax(logits.float(), dim=-1)


def activation_peak_bytes(target: torch.nn.Module, drafter: torch.nn.Module | None, backend,
                          device: torch.device, dtype: torch.dtype, num_tokens: int,
                          max_model_len: int, block_size: int, num_sampled_requests: int,
                          rows_per_request: int) -> int:
    """Bytes :func:`run_profile_forward` allocates at its peak above what was allocated
    before it (its throwaway KV caches excluded), on a CUDA ``device``; everything it
    allocated is freed, and the allocator's cache emptied, before returning."""
    items = profile_items(num_tokens, max_model_len, block_size)
    num_blocks = sum(len(it.block_table) for it in items)
    spec = target.spec
    cache = KVCache(spec.num_layers, num_blocks, block_size, target.num_local_kv_heads,
                    spec.head_dim, dtype, device)
    draft_cache = (KVCache(drafter.num_cache_layers, num_blocks, block_size, drafter.num_kv_heads,
                           drafter.head_dim, dtype, device) if drafter is not None else None)
    runner = ModelRunner(target, cache, backend, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out_of_memory = None
    try:
        run_profile_forward(target, drafter, runner, draft_cache, items, num_sampled_requests,
                            rows_per_request)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    except torch.cuda.OutOfMemoryError as e:
        # only its message is kept: the exception's traceback holds the profile's frames, and
        # with them its activations and throwaway caches, for as long as a caller keeps the
        # error (a retry with smaller flags would run out of memory again)
        out_of_memory = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
    finally:
        del runner, cache, draft_cache
        torch.cuda.empty_cache()
    if out_of_memory is not None:
        raise ValueError(
            f"the start-up profile run (gpu_memory_utilization, --gpu-memory-utilization) ran out of "
            f"memory ({out_of_memory}): one prefill step of {num_tokens} tokens "
            f"(--max-num-batched-tokens) and sampling {num_sampled_requests} x {rows_per_request} "
            f"rows (--max-num-seqs x (K + 1)) do not fit next to the weights; lower those, or set "
            f"--num-kv-blocks")
    logger.info("profile run: %d prefill tokens in %d requests, then sampling %d x %d rows: "
                "activation peak %.2f GiB", num_tokens, len(items), num_sampled_requests,
                rows_per_request, peak / 2**30)
    return peak
