"""Batch-invariant mode: every row of the target's forward computed the same way whatever the batch.

Why. Greedy DFlash is lossless only if the target's logits for a position do not depend on how
the forward that computed them was shaped. In float32 the kernels' shape-dependent summation
orders change the logits in the last bits, which never moved a token in our measurements; in
bf16 they move the rounding of every GEMM output and, at near-ties, the argmax: target-only
decoding of one prompt then differs between batch 1 and batch 8, and DFlash's verify (K + 1
rows a sequence) differs from target-only decode (1 row) in the same way (docs/PERFORMANCE.md,
twentieth pass). vLLM (``VLLM_BATCH_INVARIANT=1``) and SGLang (``--enable-deterministic-
inference``) answer this with kernels whose per-row reduction order is fixed; so does this mode.

What changes while :func:`scope` is active (the engine enters it around every step and
``prompt_logits`` when ``EngineConfig.batch_invariant``; set it with ``--batch-invariant``):

* every linear layer (Q|K|V|gate, o_proj, the router, dense MLPs, the lm_head, the drafter's) is
  :func:`linear`: the skinny GEMM's tensor-core path with ONE config per weight shape
  (:func:`linear_config`, independent of the row count) on every 16-row block, the blocks of up
  to 1024 rows in one launch. The staged o_proj GEMV, the GEMV path and cuBLAS are not used.
* the MoE experts are :func:`moe_experts`, with ``BLOCK_M`` fixed: by default (:data:`moe_kernel`
  = ``"auto"``) the fused expert kernels (kernels/fused_moe.py, chunks of at most
  :data:`MOE_MAX_ROWS` tokens) for forwards of at most :data:`MOE_FUSED_MAX_TOKENS` tokens
  (decode, verify) and the sorted grouped kernels (kernels/grouped_moe.py: the pairs sorted by
  expert once, then fixed ``BLOCK_M``-row tiles of one expert each, one launch) above (prefill),
  once :func:`sorted_agrees_with_fused` has found the two give the same bits on this GPU; else
  the fused ones everywhere. ``"fused"`` / ``"sorted"`` pin one pair. Routing takes the router
  GEMM then the per-token routing kernel (not the fused router GEMV, not the GEMV experts, not
  torch's grouped GEMM).
* attention (kernels/paged_attention.py, ``batch_invariant=True``): one query a tile (its GQA
  group's heads as the rows), 64-key tiles from key 0, the keys split every 128 from key 0 and
  the splits' partials merged in split order, for decode, verify and prefill alike.

Why each is invariant. A chunk's row ``m`` meets the same instructions in the same order as in
any other chunk: the tile shapes, warps and K steps are constants of the weight shape, a
tensor-core MMA computes each output row from that row's inputs only, and rows masked off (past
the chunk, other queries of a tile, keys past a query's causal end) contribute exact zeros. The
other kernels of a forward were per-row already: RMSNorm and the residual adds (one program a
row), Q/K norm + RoPE + cache write, the routing, the argmax.

Costs (measured in docs/PERFORMANCE.md): decode-phase GEMMs lose the GEMV configs tuned per row
count, the MoE its per-pair GEMVs, attention its split count chosen per shape; prefill runs its
GEMMs as 16-row blocks (each re-reads the weight, mostly from L2) and its MoE in 256-token
launches without the sorted kernels (each re-reads the experts it hits; the sorted kernels read
them once per 16-pair tile, mostly from L2, in one launch: prefill 3.2x faster, decode 1.6x
slower, hence ``"auto"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator

import torch

from . import fused_moe, grouped_moe, skinny_gemm

logger = logging.getLogger(__name__)

__all__ = ["MAX_ROWS", "MOE_BLOCK_M", "MOE_FUSED_MAX_TOKENS", "MOE_KERNELS", "MOE_MAX_ROWS", "check_device",
           "is_active", "linear", "linear_config", "moe_experts", "moe_kernel_for", "scope",
           "sorted_agrees_with_fused"]

MAX_ROWS = skinny_gemm.MAX_M  # rows of one GEMM block (the skinny GEMM's 16-row tile)
MOE_BLOCK_M = 16  # pairs of an MoE tile, whatever the token count
# Tokens of one fused-MoE launch. Each launch reads every expert it hits once per 16-pair tile
# of its run, so a prefill re-reads the experts once per launch: a 1k-token XS-2.1 prefill took
# 509 ms at 16 tokens a launch and 387 ms at 256 (H200, docs/PERFORMANCE.md, twenty-first
# pass). Larger chunks cost each program a longer scan of the chunk's expert ids.
MOE_MAX_ROWS = 256
# The invariant MoE kernels: "fused" (kernels/fused_moe.py, per-program grouping, chunks of
# MOE_MAX_ROWS tokens), "sorted" (kernels/grouped_moe.py, torch-sorted fixed tiles, one launch) or
# "auto": fused up to MOE_FUSED_MAX_TOKENS tokens, sorted above. Same bench run on the H200 at
# XS-2.1 size (docs/PERFORMANCE.md, twenty-third pass): "sorted" prefills 1k tokens in 128 ms
# against 406, but a batch-1 decode step takes 4.87 ms against 2.98 (its per-layer sort launches,
# fewer programs). Mixing them keeps a token's bits only because the two kernels compute a pair
# identically: both run the same tile helpers (fused_moe._gate_up_tile / _down_tile), K from 0
# upward, one MMA row per pair; on the H200 every pair was bitwise equal at T = 1..256
# (benchmarks/check_moe_kernels_agree.py). That is a property of the GPU's MMA, not a theorem, so
# "auto" checks it on the engine's own weights first (sorted_agrees_with_fused).
moe_kernel = "auto"
MOE_KERNELS = ("auto", "fused", "sorted")
# "auto": forwards of at most this many tokens take the fused kernels (the decode-phase ones: a
# batch of 64 decodes, or 16 verifies of K = 3), longer ones the sorted kernels.
MOE_FUSED_MAX_TOKENS = 64

_active = False


def is_active() -> bool:
    """Whether the forward running now must be batch-invariant (inside :func:`scope`)."""
    return _active


@contextlib.contextmanager
def scope(on: bool = True) -> Iterator[None]:
    """Run the enclosed forwards batch-invariant (``on``) or with the fast shape-tuned kernels;
    restores the previous mode on exit (engines of both kinds may share a process)."""
    global _active
    previous, _active = _active, bool(on)
    try:
        yield
    finally:
        _active = previous


def check_device(device: torch.device) -> None:
    """Raise ``ValueError`` (naming the fix) unless this mode's kernels run on ``device``: the
    skinny GEMM, the fused MoE and the paged attention (CUDA sm80+, or a CPU under
    ``TRITON_INTERPRET=1``, which the tests use)."""
    from .paged_attention import is_available as attention_runs

    # both need triton and sm80+ (or the interpreter), as the fused MoE does
    if not (skinny_gemm.is_available(device) and attention_runs(device)):
        where = "this GPU (it needs sm80+ and triton)" if device.type == "cuda" else f"{device}"
        raise ValueError(
            f"batch_invariant=True (--batch-invariant) needs the Triton kernels, which do not run "
            f"on {where}; use --device cuda on a GPU of sm80+, or drop --batch-invariant (on the "
            "CPU, --dtype float32 gives the same tokens in every batch we measured)")


@functools.lru_cache(maxsize=1024)
def linear_config(n: int, k: int) -> skinny_gemm.SkinnyConfig:
    """The one skinny-GEMM config of weight shape ``[n, k]`` in this mode: the 16-row config
    (measured where the table has it) on the tensor-core path, whatever the row count."""
    return dataclasses.replace(skinny_gemm.default_config(MAX_ROWS, n, k), use_dot=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias)`` -> ``[M, N]`` in x's dtype, row ``m`` bitwise the
    same for any ``M`` and any other rows: the skinny GEMM's tensor-core path with
    :func:`linear_config` on each :data:`MAX_ROWS`-row block, up to ``MAX_ROW_BLOCKS`` blocks a
    launch (``skinny_gemm.skinny_gemm_rows``). ``x`` of any leading shape ``[..., K]``."""
    if not skinny_gemm.can_use(x.reshape(-1, x.shape[-1])[:1], weight):
        raise ValueError(
            f"batch-invariant linear cannot run x {tuple(x.shape)} {x.dtype} on {x.device} with "
            f"weight {tuple(weight.shape)} {weight.dtype}: it needs the Triton skinny GEMM (a CUDA "
            "GPU of sm80+, or TRITON_INTERPRET=1 on a CPU) and one dtype; drop batch_invariant")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    cfg = linear_config(weight.shape[0], k)
    step = skinny_gemm.MAX_ROW_BLOCKS * MAX_ROWS
    chunks = [skinny_gemm.skinny_gemm_rows(rows[i : i + step], weight, cfg)
              for i in range(0, rows.shape[0], step)]
    out = torch.cat(chunks) if len(chunks) > 1 else (chunks[0] if chunks else rows.new_zeros(0, weight.shape[0]))
    if bias is not None:
        out = out + bias  # elementwise: per row already
    return out.view(*lead, weight.shape[0])


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, has_skipped_pairs: bool = False) -> torch.Tensor:
    """The routed experts' weighted pair outputs ``[T, k, H]`` (unsummed, as
    ``fused_moe.fused_moe_experts(..., reduce=False)``), token ``t``'s bitwise the same for any
    ``T`` and any other tokens, through :func:`moe_kernel_for`'s kernels with ``BLOCK_M`` fixed
    at :data:`MOE_BLOCK_M` (a pair's tile computes the same whichever other pairs share it):
    "fused", :data:`MOE_MAX_ROWS`-token chunks with the tile loop sized for a full chunk (one
    compile per pair-count bucket, not per prompt length); "sorted", one launch.
    ``has_skipped_pairs``: ``expert_ids`` (``[T, k]``, in ``[0, E)``) may also hold ``-1``, a
    pair skipped under expert parallelism: its row is exactly zero, no weight is read for it,
    and the other rows keep their bits (both kernels' contract)."""
    if moe_kernel_for(x.shape[0], gate_up, down) == "sorted":
        return grouped_moe.sorted_moe_experts(x, expert_ids, weights, gate_up, down, block_m=MOE_BLOCK_M,
                                              has_skipped_pairs=has_skipped_pairs)
    return _fused_experts(x, expert_ids, weights, gate_up, down, has_skipped_pairs=has_skipped_pairs)


def _fused_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, has_skipped_pairs: bool = False) -> torch.Tensor:
    n = MOE_MAX_ROWS
    chunks = [fused_moe.fused_moe_experts(x[i : i + n], expert_ids[i : i + n], weights[i : i + n],
                                          gate_up, down, reduce=False, block_m=MOE_BLOCK_M,
                                          max_tokens=n, has_skipped_pairs=has_skipped_pairs)
              for i in range(0, x.shape[0], n)]
    if not chunks:
        return x.new_zeros(0, expert_ids.shape[1], x.shape[1])
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def moe_kernel_for(num_tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> str:
    """The invariant MoE kernels ("fused" or "sorted") for a forward of ``num_tokens`` tokens on
    these expert weights, by :data:`moe_kernel`. ``"auto"`` takes "sorted" above
    :data:`MOE_FUSED_MAX_TOKENS` only where :func:`sorted_agrees_with_fused` holds; while a CUDA
    graph is being captured an unchecked weight shape takes "fused" (the check syncs)."""
    if moe_kernel not in MOE_KERNELS:
        raise ValueError(f"batch_invariant.moe_kernel={moe_kernel!r}: use one of {MOE_KERNELS}")
    if moe_kernel != "auto":
        return moe_kernel
    if num_tokens <= MOE_FUSED_MAX_TOKENS:
        return "fused"
    key = _agreement_key(gate_up, down)
    if key not in _agreement:
        if _capturing(gate_up):
            return "fused"
        sorted_agrees_with_fused(gate_up, down)
    return "sorted" if _agreement[key] else "fused"


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


# (device, dtype, gate_up shape, down shape) -> whether the two kernel pairs gave the same bits
_agreement: dict[tuple, bool] = {}


def _agreement_key(gate_up: torch.Tensor, down: torch.Tensor) -> tuple:
    return (str(gate_up.device), gate_up.dtype, tuple(gate_up.shape), tuple(down.shape))


def sorted_agrees_with_fused(gate_up: torch.Tensor, down: torch.Tensor, num_tokens: int = 37,
                             top_k: int = 8) -> bool:
    """Whether the sorted and the fused invariant kernels give bitwise the same pair outputs on
    these expert weights (``gate_up [E, 2I, H]``, ``down [E, H, I]``) for ``num_tokens`` random
    tokens routed to ``min(top_k, E)`` experts each (runs of several pairs and of one). Runs
    once per device, dtype and weight shape (cached; the result syncs the host), and logs the
    outcome; "auto" keeps the fused kernels everywhere where it is False."""
    key = _agreement_key(gate_up, down)
    if key in _agreement:
        return _agreement[key]
    e, _, hidden = gate_up.shape
    k = min(top_k, e)
    g = torch.Generator(device=gate_up.device).manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=g, device=gate_up.device).to(gate_up.dtype)
    scores = torch.rand(num_tokens, e, generator=g, device=gate_up.device)
    scores[: num_tokens // 2, : 2 * k] += 1  # half the tokens share 2k experts: long runs too
    ids = scores.argsort(dim=1, descending=True)[:, :k]
    weights = torch.rand(num_tokens, k, generator=g, device=gate_up.device)
    fused = _fused_experts(x, ids, weights, gate_up, down)
    ours = grouped_moe.sorted_moe_experts(x, ids, weights, gate_up, down, block_m=MOE_BLOCK_M)
    agrees = _agreement[key] = bool(torch.equal(fused, ours))
    if agrees:
        logger.info("batch-invariant MoE: the sorted kernels give the fused kernels' bits on %s "
                    "(%s, experts %s): fused up to %d tokens a forward, sorted above",
                    gate_up.device, gate_up.dtype, tuple(gate_up.shape), MOE_FUSED_MAX_TOKENS)
    else:
        logger.warning("batch-invariant MoE: the sorted kernels do not give the fused kernels' bits "
                       "on %s (%s, experts %s); using the fused kernels at every size (prefill is "
                       "slower)", gate_up.device, gate_up.dtype, tuple(gate_up.shape))
    return agrees
