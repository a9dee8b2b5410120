"""Request lifecycle: load models, size the KV cache, run scheduled steps, collect outputs."""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..config import (
    EngineConfig,
    SamplingParams,
    SpeculativeConfig,
    flag,
    resolve_device,
    resolve_dtype,
)
from ..distributed import SINGLE, TensorParallel, init_tensor_parallel
from ..kernels import batch_invariant, paged_attention
from ..kernels.accept_pack import accept_and_pack
from ..models.config_utils import with_generation_eos_ids
from ..models.draft_vocab import load_token_map
from ..models.fp8 import quantize_drafter
from ..models.layers import build_lm_head_ahead, build_sorted_moe_kernels_ahead, fuse_for_inference
from ..models.loader import describe_checkpoint, load_model
from ..models.registry import DRAFT_ARCHITECTURES
from . import cuda_graph, sampler
from .adaptive_k import AdaptiveK, BatchSizeK, FixedK
from .ahead import DraftsAhead, ForwardAhead, PlannedForward
from .attention import get_attention_backend, resolve_backend_name
from .context_graph import ContextGraphRunner
from .cuda_graph import CUDAGraphRunner, build_kernels_ahead
from .kv_cache import BlockAllocator, HybridLayout, KVCache
from .memory_profile import activation_peak_bytes, kv_cache_budget_bytes
from .penalties import penalized_rows
from .runner import ForwardItem, HostCopy, ModelRunner, forward_item, to_device_async
from .sampler import sample_rows, top_logprobs
from .scheduler import Scheduler
from .sequence import Sequence
from .spec_decode import DFlashProposer, SpecDecodingStats

logger = logging.getLogger(__name__)

_CPU_KV_BUDGET_BYTES = 2 << 30

# True: the verify forward writes the drafter's context K/V of all its K + 1 rows itself, inside
# its CUDA graph, before the step's host sync (the next step starts with the drafter block).
# Rows past the accepted ones are rejected drafts' context, at positions the drafter never reads
# before rewriting them: a slot is read only at a committed position (whose correct context is
# stored after its commit, so after any such write) or inside a drafter block (which writes its
# own K/V there first). False: the committed rows become pending taps, stored by the next
# step's propose (an A/B switch for benchmarks).
store_context_in_verify = True
# True: under the hybrid KV layout a drafter whose layers all slide keeps its context K/V in a
# sliding group of the pool (LLMEngine._hybrid_layout); False: in a full-context cache of its
# own (an A/B switch for benchmarks/bench_hybrid_kv.py)
drafter_in_sliding_group = True

# True: each DFlash step queues the NEXT step's drafter block right behind its own acceptance,
# from device values (anchors P + a + 1, bonus tokens t_a), before its host sync waits; the host
# then commits and schedules while the GPU drafts. The next step uses those drafts when its batch
# is the same requests with the same K at the anchors assumed, else it proposes as usual. Needs
# store_context_in_verify (no pending taps) and the drafter's CUDA graph runner. False: every
# step proposes after the previous one's sync (an A/B switch for benchmarks).
draft_ahead = True

# A target-only step queues the NEXT step's target forward behind its own sampling, with the
# sampled tokens as input ids on the device (positions are known on the host), before its host
# sync; the next step takes those hidden states (and, with a drafter, the taps, which then join
# the pending taps as a fresh forward's would) when every request of its batch was in that
# forward at the position assumed (engine/ahead.py). Sampling stays in the step itself (seeded
# noise is a function of position). With a drafter the next step must be target-only too: fixed
# K = 0, or adaptive K whose policy expects K = 0 next (AdaptiveK.expects_target_only); a queued
# forward the next step does not take is wasted work, never a wrong token. None: where the
# target runs CUDA graphs
# (the host then commits and schedules while the GPU computes; H200 batch-1 step 2.72 -> 2.42 ms,
# docs/PERFORMANCE.md); elsewhere the queued forward would only run early, and is wasted when a
# request stops. True: always (the CPU tests run it eagerly). False: never (A/B switch).
decode_ahead: bool | None = None
# True: that forward's rows are uploaded before the step's lm_head (on a side stream, while the
# lm_head runs; CUDAGraphRunner.stage_decode), and a greedy step's argmax writes the tokens into
# the decode graph's input ids itself: after the argmax the GPU only waits for an event before
# the replay, where it ran a row upload and an id copy (~10-20 us a step with their copy-engine
# gaps, docs/PERFORMANCE.md, eighty-first pass). False: upload and copy after the lm_head (A/B).
stage_forward_ahead = True

# True: a step whose requests are all greedy (temperature 0) with no logprobs and no penalties
# takes its tokens from the lm_head's int8 copy with exact bounds (kernels/greedy_lm_head.py:
# the argmax of the full-precision logits, about half the lm_head's bytes) instead of the logits
# and the sampler; the copy is built at start-up, before the KV cache is sized (XS-2.1: 207 MB).
# The bf16 drafter's drafts take it too (DFlashDraftModel.draft_tokens). On an H100 the batch-1
# XS-2.1 decode step took 2.48 against 2.53 ms, the DFlash K = 3 step 5.18 against 5.28, tokens
# equal (docs/PERFORMANCE.md, seventy-ninth pass). False: the logits every step (an A/B switch).
greedy_int8_lm_head = True

# Prompt-length batches the warm-up prefills (one token each, after its two decoding requests),
# so that the first real prompts of these kinds build no kernel. Triton compiles a kernel per
# constexpr set and per specialisation of its integer arguments (== 1, a multiple of 16, other):
# the attention kernel's token count T and longest prompt L (its query tile saturates past a few
# tokens; one key split from ~300 tokens on, more below), the fused MoE's pair-count bucket
# (short prompts). Hence: 1 token; the fused-MoE buckets of 5 and 20 tokens; a two-split
# length; single long prompts with T = L not / a multiple of 16; two long prompts with T a
# multiple of 16 and L not, and the reverse. Measured by benchmarks/bench_first_request.py.
WARMUP_PREFILL_LENGTHS: tuple[tuple[int, ...], ...] = (
    (1,), (5,), (20,), (200,), (208,), (300,), (320,), (300, 292), (320, 280))

# With ``cuda_graph_max_bs`` below ``max_num_seqs``, batches above the cap run eagerly, and their
# forwards launch Triton variants no graph built: the warm-up then serves eager batches too
# (:func:`eager_warmup_batch_sizes`; False: it does not, an A/B switch for benchmarks).
warmup_eager_batches = True
# The largest eager batch the warm-up serves. Past a few dozen tokens a forward's variants stop
# changing (the MoE takes the sorted kernels, built ahead, past 256 pairs; attention of many
# programs splits keys by its own count; the multiple-of-16 specialisation is met at 16-64), and
# each size is served whole: with --max-num-seqs 1000000 (a memory test's) the warm-up asked for
# every power of two up to 524288 requests, served as far as the KV cache held them.
MAX_EAGER_WARMUP_BATCH = 256


def eager_warmup_batch_sizes(max_graph_batch_size: int, max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes the warm-up serves eagerly when CUDA graphs stop at
    ``max_graph_batch_size`` (``--cuda-graph-max-bs``) below ``max_num_seqs``: the first eager
    size, each power of two above it and ``max_num_seqs``, none above
    :data:`MAX_EAGER_WARMUP_BATCH` (which stands in for the larger ones). An eager step's Triton
    variants follow its token count's power-of-two bucket (the fused MoE's tile and pair padding)
    and its specialisation (a multiple of 16 or not); ``()`` when every batch replays a graph."""
    first = max_graph_batch_size + 1
    if first > max_num_seqs:
        return ()
    last = min(max_num_seqs, max(first, MAX_EAGER_WARMUP_BATCH))
    powers = [1 << i for i in range(first.bit_length(), last.bit_length())]
    return tuple(sorted({first, last, *powers}))


@dataclass
class EngineTimings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_steps: int = 0
    num_decode_steps: int = 0
    extra: dict = field(default_factory=dict)


class StepError(RuntimeError):
    """A step's forward failed; ``sequences`` are the requests that step held (the caller can fail
    exactly those and keep serving the others)."""

    def __init__(self, sequences: list[Sequence], cause: BaseException) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.sequences = sequences


class LLMEngine:
    """Owns the target (and optional DFlash drafter), the paged caches and the scheduler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        info = describe_checkpoint(config.model, config.load_format)
        # every rank runs this engine on the same requests; the target is sharded, its outputs
        # (hidden states, taps, logits) are the same bits on every rank, so every decision is too
        device = resolve_device(config.device)  # checked before any process group starts
        self.dtype = resolve_dtype(config.dtype, info.config, device)
        self.tp = init_tensor_parallel(config.tensor_parallel_size, device,
                                       config.enable_expert_parallel)
        if self.tp.is_parallel and device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # LOCAL_RANK's GPU
        self.device = device
        if info.architecture in DRAFT_ARCHITECTURES:
            raise ValueError(
                f"{config.model} holds a drafter ({info.architecture}); pass it as draft=, and the "
                "target checkpoint as model="
            )
        self.model_config = info.config
        self.target = load_model(config.model, self.dtype, self.device, config.load_format,
                                 tp=self.tp)
        spec = self.target.spec
        if config.max_model_len is not None and config.max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} (--max-model-len) is more than the model's "
                f"max_position_embeddings ({spec.max_position_embeddings}); ask for at most that, "
                "or leave it unset")
        self.max_model_len = config.max_model_len or min(spec.max_position_embeddings, 8192)
        self.drafter = None
        self.num_speculative_tokens = 0
        if config.speculative is not None:
            self._load_drafter(config)
        k = self.num_speculative_tokens
        if self.device.type == "cuda":  # the fast path's weight layout (same values)
            for model in (self.target, self.drafter):
                if model is not None:
                    fuse_for_inference(model)
            torch.cuda.empty_cache()  # the replaced tensors' blocks: free for the KV cache sizing
        if self.drafter is not None and config.speculative.speculative_token_map is not None:
            ids = load_token_map(config.speculative.speculative_token_map, spec.vocab_size)
            self.drafter.set_draft_vocab(ids)  # before the fp8 copy: it quantizes these rows
            logger.info("draft vocabulary: %d of %d tokens (%s)", ids.numel(), spec.vocab_size,
                        config.speculative.speculative_token_map)
        if self.drafter is not None and config.speculative.draft_quantization == "fp8":
            saved = quantize_drafter(self.drafter)  # before the KV cache is sized
            logger.info("drafter quantized to fp8 (MLP gate|up, lm_head copy): %.1f MiB fewer bytes "
                        "a block and its lm_head stream in launches of up to 16 rows", saved / 2**20)
        if greedy_int8_lm_head:
            nbytes = self.target.quantize_lm_head_int8()  # before the KV cache is sized
            if nbytes:
                logger.info("lm_head int8 copy for greedy steps: %.1f MiB", nbytes / 2**20)
        max_positions = self.max_model_len + k + 1
        self.target.prepare_rope(max_positions, self.device)
        if self.drafter is not None:
            self.drafter.prepare_rope(max_positions, self.device)
        # config.json's, then generation_config.json's (where instruct models list end-of-turn)
        self.eos_token_ids = with_generation_eos_ids(config.model, spec.eos_token_ids)
        self.backend = get_attention_backend(self._attention_backend_name(config))
        self.kv_layout = self._hybrid_layout(config)
        blocks_per_seq = -(-max_positions // config.block_size)
        # an explicit num_kv_blocks counts blocks of every layer (and the drafter's): a hybrid
        # layout's blocks hold one group's layers, so the same memory is more of them
        explicit_blocks = config.num_kv_blocks
        if self.kv_layout is not None:  # and the SWA groups' blocks of a window and a prefill step
            window_tokens = min(max_positions, self.kv_layout.sliding_window + self.prefill_token_budget + k + 1)
            blocks_per_seq += self.kv_layout.num_swa_groups * (-(-window_tokens // config.block_size) + 1)
            num_draft = self.drafter.num_cache_layers if self.drafter is not None else 0
            if explicit_blocks:
                explicit_blocks = (explicit_blocks * (spec.num_layers + num_draft)
                                   // (self.kv_layout.group_size + self._num_own_draft_layers))
        # gpu_memory_utilization's profiled activation peak (bytes; 0: no profile ran)
        self.profiled_activation_bytes = 0
        # the same count on every rank (the scheduler's decisions depend on it)
        num_blocks = explicit_blocks or self.tp.min_int(self._default_num_blocks(blocks_per_seq), self.device)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"num_kv_blocks={config.num_kv_blocks or num_blocks} cannot hold one max_model_len="
                f"{self.max_model_len} sequence ({blocks_per_seq} blocks of {config.block_size}"
                f"{'' if self.kv_layout is None else f' of the hybrid layout, which has {num_blocks}'}); "
                "raise it or lower max_model_len"
            )
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        # the blocks one max_model_len request may hold at once: its full table, and each SWA
        # group's window plus a prefill step (vLLM's sizing of a sliding-window group)
        self.max_blocks_per_seq = blocks_per_seq
        self._num_swa_blocks_per_seq = blocks_per_seq - -(-max_positions // config.block_size)
        kv = KVCache(spec.num_layers, num_blocks, config.block_size, self.target.num_local_kv_heads,
                     spec.head_dim, self.dtype, self.device, self.kv_layout)
        self.runner = ModelRunner(self.target, kv, self.backend, self.device)
        self.proposer = None
        self.spec_stats = SpecDecodingStats(k) if k else None
        sim = config.speculative.simulate_acceptance_length if config.speculative else None
        self.simulated_acceptance = sim if k else None
        self._sim_carry = 0.0
        self._sim_counts_on_device: dict[tuple[int, ...], torch.Tensor] = {}  # read only, never written
        if self.simulated_acceptance is not None:
            logger.warning("simulated acceptance length %.2f: drafts are accepted without checking, "
                           "output is NOT the target's (benchmarking only)", sim)
        # the K policy a decode step asks (None: K every step): adaptive K, or a schedule by batch size
        self.k_policy = self._k_policy(config, k)
        if self.drafter is not None:
            d = self.drafter
            dkv = (kv.drafter_view() if kv.draft_group else
                   KVCache(d.num_cache_layers, num_blocks, config.block_size, d.num_kv_heads,
                           d.head_dim, self.dtype, self.device))
            self.proposer = DFlashProposer(d, dkv, ModelRunner(d, dkv, self.backend, self.device), k,
                                           draft_group=kv.draft_group)
            assert dkv.scratch_slot == kv.scratch_slot  # one slot index space (store_rows)
            self.runner.context_store = self.proposer.store_rows
        if self.device.type == "cuda" and not config.enforce_eager:
            self.attach_graph_runners()
        self.scheduler = Scheduler(
            self.allocator, config.max_num_seqs,
            self.prefill_token_budget, num_lookahead=k,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            layout=self.kv_layout, scheduling_policy=config.scheduling_policy,
        )
        self.tap_layer_ids = tuple(self.drafter.target_layer_ids) if self.drafter is not None else ()
        self._ids = itertools.count()
        self.timings = EngineTimings()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._ahead: DraftsAhead | ForwardAhead | None = None  # queued by the last step
        # rank 0 leading follower ranks (:meth:`lead`): the adds, aborts and steps not yet sent
        self._ops: list[tuple] | None = None
        logger.info(
            "engine ready: %s, dtype=%s, device=%s, max_model_len=%d, kv blocks=%d x %d (%s), spec=%s, "
            "attention=%s, cuda graphs=%s, batch-invariant=%s", info.architecture, self.dtype,
            self.device, self.max_model_len, num_blocks, config.block_size,
            "unified" if self.kv_layout is None else
            f"hybrid: blocks of {self.kv_layout.group_size} layers, {self.kv_layout.num_swa_groups} "
            f"sliding-window groups{' (the drafter in one)' if self.kv_layout.draft_group else ''} "
            f"kept within {self.kv_layout.sliding_window} positions",
            f"dflash K={k}" if k else "off", self.backend.name, self.runner.graphs is not None,
            config.batch_invariant,
        )
        logger.info("KV cache size: %d tokens; maximum concurrency for %d tokens per request: %.2fx",
                    self.kv_cache_size_tokens, self.max_model_len, self.max_concurrency)
        if self.device.type == "cuda":
            self.warmup()

    @property
    def kv_cache_size_tokens(self) -> int:
        """Tokens of context the KV cache holds (vLLM's "KV cache size"): every block in full
        tables, less one request's blocks of the SWA groups (hybrid layout)."""
        return (self.allocator.num_blocks - self._num_swa_blocks_per_seq) * self.allocator.block_size

    @property
    def max_concurrency(self) -> float:
        """How many ``max_model_len`` requests the KV cache holds at once (vLLM's "maximum
        concurrency"), each at its most blocks (:attr:`max_blocks_per_seq`)."""
        return self.allocator.num_blocks / self.max_blocks_per_seq

    # ---- setup ---------------------------------------------------------------------------------

    def _hybrid_layout(self, config: EngineConfig) -> HybridLayout | None:
        """The KV layout (``kv_cache.HybridLayout``; None: unified). A drafter whose layers all
        slide, whose K/V rows have the target's shape (under tensor parallelism: sharded as the
        target, not replicated) keeps its context in a sliding group of its own."""
        if config.disable_hybrid_kv_cache_manager:
            return None
        layout = HybridLayout.for_layers([layer.sliding_window for layer in self.target.spec.layers])
        d = self.drafter
        if (layout is None or d is None or not drafter_in_sliding_group
                or d.num_kv_heads != self.target.num_local_kv_heads
                or d.head_dim != self.target.spec.head_dim):
            return layout
        return layout.with_drafter([layer.sliding_window for layer in d.spec.layers])

    @property
    def _num_own_draft_layers(self) -> int:
        """The drafter's layers in a cache of their own (not in the hybrid layout's pool)."""
        if self.drafter is None or (self.kv_layout is not None and self.kv_layout.draft_group):
            return 0
        return self.drafter.num_cache_layers

    def _attention_backend_name(self, config: EngineConfig) -> str:
        """The backend to build; with ``batch_invariant`` the paged Triton kernels, which must
        run here (:func:`batch_invariant.check_device`)."""
        if not config.batch_invariant:
            return resolve_backend_name(config.attention_backend, self.device)
        batch_invariant.check_device(self.device)
        if config.attention_backend == "torch_sdpa":
            raise ValueError("batch_invariant=True (--batch-invariant) runs attention in its Triton "
                             "kernel; drop --attention-backend torch_sdpa (or set it to triton/auto)")
        return "triton"

    def warmup(self) -> None:
        """Serve two short greedy requests (with adaptive K, one more at each of its draft
        levels, :func:`adaptive_k.draft_levels`), then prefill the prompt shapes of
        :data:`WARMUP_PREFILL_LENGTHS`, and forget them, so the first real request does not pay
        the one-time work: ``torch.compile`` of the fused chains (it specialises on the first
        prompt length and compiles a dynamic version at the second), Triton builds, and the
        batch-1 CUDA graphs (decode, or verify + drafter block + drafter context); then, with
        ``cuda_graph_capture="startup"``, the graphs of every batch size and key bucket.
        Statistics, timings and the adaptive-K state are reset afterwards; blocks return to the
        pool."""
        t0 = time.perf_counter()
        # every warm-up prefill computes its whole prompt (the shapes are the point)
        caching, self.scheduler.enable_prefix_caching = self.scheduler.enable_prefix_caching, False
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for n in (8, 16):
            n = max(1, min(n, self.max_model_len - params.max_tokens - self.num_speculative_tokens - 1))
            self._serve_to_the_end([[0] * n], params)
        if self.k_policy is not None:
            # a K policy drafts at each of its levels once (adaptive K's first requests above
            # ran K = 0 and the full K), so the start-up capture below holds every verify and
            # drafter-block shape it may choose: a level first chosen while serving would stall
            # its step for the captures of its batch size and key bucket
            policy = self.k_policy
            levels = policy.levels[1:-1] if isinstance(policy, AdaptiveK) else policy.levels
            try:
                for level in levels:
                    self.k_policy = FixedK(level)
                    self._serve_to_the_end([[0] * n], params)  # the second request's length
            finally:
                self.k_policy = policy
        if warmup_eager_batches:
            self._warmup_eager_batches(params)
        # the kernels a sampled step launches and greedy ones do not: built now, not by the
        # first sampled request (seeded noise, the race's argmax, top-k values)
        num_built = sampler.build_ahead(self.target.spec.vocab_size, self.device)
        logger.debug("built %d sampling kernel variants ahead", num_built)
        # the lm_head's skinny GEMM at the row counts a first batch size brings, and its int8
        # copy's greedy launches (models/layers.py)
        num_built = build_lm_head_ahead(self.target.lm_head_weight, self.target.lm_head_int8)
        logger.debug("built %d lm_head GEMM variants ahead", num_built)
        # the sorted MoE kernels of every tile height (past 256 pairs a forward; the height
        # follows the token count): built now, not by a first long eager prefill (half
        # precision, as the warm-up prefills below)
        if not self.config.batch_invariant and self.dtype in (torch.bfloat16, torch.float16):
            num_built = build_sorted_moe_kernels_ahead(self.target)
            logger.debug("built %d sorted MoE kernel variants ahead", num_built)
        # half precision only: float32 engines serve parity checks and tests, where start-up
        # time counts more than a first long prompt's (their MoE prefills past 256 pairs take
        # the sorted kernels since 2026-12-02: the fused ones' builds there ran for minutes)
        shapes = WARMUP_PREFILL_LENGTHS if self.dtype in (torch.bfloat16, torch.float16) else ()
        # these build the EAGER prefill's kernels (longer prompts, larger batches still run it),
        # so no prefill graph takes them (the graphs are captured at start-up, or on first use)
        graphs = self.runner.graphs
        buckets = graphs.prefill_buckets if graphs is not None else ()
        if graphs is not None:
            graphs.prefill_buckets = ()
        try:
            self._warmup_prefills(shapes)
        finally:
            if graphs is not None:
                graphs.prefill_buckets = buckets
        k = self.num_speculative_tokens
        self.timings = EngineTimings()
        self.spec_stats = SpecDecodingStats(k) if k else None
        if isinstance(self.k_policy, AdaptiveK):  # what the warm-up taught it is forgotten
            self.k_policy = AdaptiveK(k)
        self._sim_carry = 0.0
        self._ids = itertools.count()
        self._ahead = None
        self.scheduler.enable_prefix_caching = caching
        logger.info("warm-up done in %.1fs", time.perf_counter() - t0)
        if self.config.cuda_graph_capture == "startup":
            if self.runner.graphs is not None:
                self.runner.graphs.add_prefill_kinds(self.tap_layer_ids)
            self.capture_all_graphs()

    def _warmup_eager_batches(self, params: SamplingParams) -> None:
        """Serve batches of each of :func:`eager_warmup_batch_sizes` (every size from 1 under
        ``enforce_eager``; at every adaptive-K level) of 8-token prompts, then of prompts past
        two attention key splits (``paged_attention._MIN_SPLIT_KEYS``): a batch of few programs
        splits long keys, a variant of its own (per specialisation of its token count; eager
        forwards take one split count for every key length, ``triton_attention.
        fixed_eager_splits``). Batches the KV cache or ``max_model_len`` cannot hold are
        skipped."""
        if self.runner.graphs is not None:
            cap = self.max_graph_batch_size
        elif self.config.enforce_eager and self.device.type == "cuda":
            cap = 0  # every step eager
        else:
            return
        sizes = eager_warmup_batch_sizes(cap, self.config.max_num_seqs)
        if not sizes:
            return
        k, bs = self.num_speculative_tokens, self.config.block_size
        capacity = self.allocator.num_blocks * bs
        batches = [(r, n) for n in (8, 2 * paged_attention._MIN_SPLIT_KEYS + 8) for r in sizes]
        policy = self.k_policy
        levels = policy.levels if policy is not None else (k,)
        t0 = time.perf_counter()
        try:
            for level in levels:
                if policy is not None:
                    self.k_policy = FixedK(level)
                for r, n in batches:
                    need = r * (n + params.max_tokens + k + 2 + bs)
                    if n + params.max_tokens + k + 1 < self.max_model_len and need <= capacity:
                        self._serve_to_the_end([[0] * n for _ in range(r)], params)
        finally:
            self.k_policy = policy
        logger.info("served eager batches of %s requests (%s) in %.1fs", ", ".join(map(str, sizes)),
                    "--enforce-eager" if cap == 0 else f"above --cuda-graph-max-bs {cap}",
                    time.perf_counter() - t0)

    def _warmup_prefills(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        """Prefill each shape (its prompts in one step, one token each) this engine can hold."""
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        capacity = self.allocator.num_blocks * self.config.block_size
        for lengths in shapes:
            need = sum(n + self.num_speculative_tokens + 2 + self.config.block_size for n in lengths)
            if (max(lengths) + self.num_speculative_tokens + 2 > self.max_model_len or need > capacity
                    or len(lengths) > self.config.max_num_seqs
                    or sum(lengths) > self.config.max_num_batched_tokens):
                continue  # a shape this engine never prefills
            self._serve_to_the_end([[0] * n for n in lengths], one)

    def _serve_to_the_end(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Add ``prompts`` (token ids) and step until no request is left (the warm-up's)."""
        for prompt in prompts:
            self.add_request(prompt, params)
        while self.has_unfinished:
            self.step()

    def capture_all_graphs(self) -> int:
        """Capture the CUDA graphs of every padded batch size and key bucket for each forward
        kind the warm-up ran (``EngineConfig.cuda_graph_capture="startup"``), with a progress
        bar on a terminal. -> graphs captured."""
        t0 = time.perf_counter()
        runners = [r.graphs for r in [self.runner] + ([self.proposer.runner] if self.proposer else [])
                   if r.graphs is not None]
        context_graphs = self.proposer.context_graphs if self.proposer else None
        total = (sum(len(g.missing_keys(self.max_model_len)) for g in runners)
                 + (len(context_graphs.missing_sizes()) if context_graphs is not None else 0))
        if self.device.type != "cuda" or not total:
            return 0
        count = 0
        with batch_invariant.scope(self.config.batch_invariant), torch.inference_mode():
            if cuda_graph.build_ahead:
                forwards = [f for g in runners for f in g.forwards_to_capture(self.max_model_len)]
                if context_graphs is not None:
                    forwards += context_graphs.forwards_to_capture()
                build_kernels_ahead(forwards, self.device)
            with tqdm(total=total, desc="capturing CUDA graphs", unit="graph", disable=None) as bar, \
                    cuda_graph.captures_in_a_row(self.device):
                for graphs in runners:
                    count += graphs.capture_all(self.max_model_len, bar)
                if context_graphs is not None:
                    count += context_graphs.capture_all(bar)
        logger.info("captured %d CUDA graphs at start-up in %.1fs (--cuda-graph-capture lazy "
                    "skips this)", count, time.perf_counter() - t0)
        return count

    @property
    def max_graph_batch_size(self) -> int:
        """The largest padded batch the graph runners capture (``EngineConfig.graph_batch_cap``);
        larger batches run eagerly."""
        return self.config.graph_batch_cap

    def attach_graph_runners(self) -> None:
        """Route the target's and the drafter's decode-phase forwards through a
        :class:`CUDAGraphRunner` (on CPU it runs the same padded forward eagerly: tests), and
        with ``graph_context_precompute`` the drafter's context precompute too."""
        for runner in [self.runner] + ([self.proposer.runner] if self.proposer else []):
            runner.graphs = CUDAGraphRunner(runner.model, runner.kv_cache, self.backend, self.device,
                                            self.max_graph_batch_size, self.max_model_len,
                                            self.num_speculative_tokens + 1,
                                            self.config.max_prefill_graph_tokens if runner is self.runner else 0)
            # a graphed forward's positions may pass max_model_len + K + 1 (a prefill bucket's
            # padding, a drafter block queued ahead): tables short of them are read out of
            # bounds (an illegal address on CUDA)
            runner.model.prepare_rope(runner.graphs.max_positions, self.device)
        if self.proposer is not None and self.config.graph_context_precompute:
            self.attach_context_graphs()

    def attach_context_graphs(self) -> None:
        """Route the drafter's decode-step context precompute through a
        :class:`ContextGraphRunner` (``EngineConfig.graph_context_precompute``; on CPU it runs
        the same padded computation eagerly: tests)."""
        taps = len(self.drafter.target_layer_ids) * self.target.spec.hidden_size
        self.proposer.context_graphs = ContextGraphRunner(
            self.drafter, self.proposer.kv_cache, self.device, self.max_graph_batch_size,
            self.proposer.num_speculative_tokens + 1, taps, self.dtype)  # K_max + 1 rows

    def _load_drafter(self, config: EngineConfig) -> None:
        sc = config.speculative
        info = describe_checkpoint(sc.draft, config.load_format)
        if info.architecture not in DRAFT_ARCHITECTURES:
            raise ValueError(
                f"draft={sc.draft} holds {info.architecture}, not a DFlash drafter; supported: "
                f"{', '.join(sorted(DRAFT_ARCHITECTURES))}"
            )
        self.drafter = load_model(sc.draft, self.dtype, self.device, config.load_format,
                                  target=self.target, tp=self._draft_tp(sc))
        if self.tp.is_parallel:
            logger.info("the drafter is %s", f"sharded over {self.tp.world_size} ranks"
                        if self.drafter.tp.is_parallel else "replicated on every rank")
        block = self.drafter.block_size
        k = sc.num_speculative_tokens or block - 1
        if k > block - 1:
            logger.warning(
                "num_speculative_tokens=%d exceeds the drafter's trained block_size-1=%d; "
                "acceptance will suffer", k, block - 1,
            )
        self.num_speculative_tokens = k

    @staticmethod
    def _k_policy(config: EngineConfig, k: int) -> AdaptiveK | BatchSizeK | None:
        """``--adaptive-k``'s :class:`AdaptiveK`, a ``num_speculative_tokens_per_batch_size``
        :class:`BatchSizeK` (a ``ValueError`` where it drafts more than K tokens or leaves a batch
        size up to ``max_num_seqs`` out), or None (K every step)."""
        sc = config.speculative
        if sc is None or not k:
            return None
        if sc.adaptive:
            return AdaptiveK(k)
        schedule = sc.num_speculative_tokens_per_batch_size
        if schedule is None:
            return None
        name = "num_speculative_tokens_per_batch_size"
        too_many = [list(r) for r in schedule if r[2] > k]
        if too_many:
            raise ValueError(f"{name}: {too_many[0]} drafts more than num_speculative_tokens={k} "
                             f"tokens; lower its K to at most {k}")
        covered = 1  # the first batch size no range has reached yet
        for lo, hi, _ in schedule:
            if lo > covered:
                break
            covered = max(covered, hi + 1)
        if covered <= config.max_num_seqs:
            raise ValueError(f"{name}: no range holds batch size {covered}; every batch size from 1 "
                             f"to max_num_seqs={config.max_num_seqs} (--max-num-seqs) needs one K "
                             f"(0: no drafting), e.g. add [{covered}, {config.max_num_seqs}, 0]")
        return BatchSizeK(schedule)

    def _draft_tp(self, sc: SpeculativeConfig) -> TensorParallel | None:
        """The drafter's tensor parallelism from ``draft_tensor_parallel_size``: 1 ``SINGLE``
        (replicated), the target's size the target's (sharded), None chosen by the drafter's
        widths (``dflash.resolve_draft_tp``)."""
        size = sc.draft_tensor_parallel_size
        if size is None:
            return None
        if size == 1:
            return SINGLE
        if size != self.tp.world_size:
            raise ValueError(
                f"draft_tensor_parallel_size={size} (--draft-tensor-parallel-size) must be 1 "
                f"(the drafter replicated on every rank) or the target's tensor_parallel_size "
                f"({self.tp.world_size}, the drafter sharded), as in vLLM")
        return self.tp

    @property
    def prefill_token_budget(self) -> int:
        """The most prompt tokens one prefill step computes (the scheduler's token budget):
        ``max_num_batched_tokens``; without chunked prefill a prompt is computed whole, so at
        least ``max_model_len``."""
        c = self.config
        return (c.max_num_batched_tokens if c.enable_chunked_prefill
                else max(c.max_num_batched_tokens, self.max_model_len))

    def _default_num_blocks(self, blocks_per_seq: int) -> int:
        """KV blocks for ``max_num_seqs`` full-length sequences, at most what the memory budget
        holds (:mod:`memory_profile`), at least one sequence's ``blocks_per_seq``."""
        spec, config = self.target.spec, self.config
        # a hybrid layout's block holds one group's layers (kv_cache.HybridLayout)
        num_layers = self.kv_layout.group_size if self.kv_layout is not None else spec.num_layers
        per_block = KVCache.bytes_per_block(num_layers, config.block_size,
                                            self.target.num_local_kv_heads, spec.head_dim, self.dtype)
        if self._num_own_draft_layers:  # its own cache (every rank's rows, where replicated)
            d = self.drafter
            per_block += KVCache.bytes_per_block(d.num_cache_layers, config.block_size,
                                                 d.num_kv_heads, d.head_dim, self.dtype)
        field = "gpu_memory_utilization" if config.gpu_memory_utilization is not None else "mem_fraction_static"
        fraction = getattr(config, field)
        if self.device.type == "cuda":
            activations = 0
            if config.gpu_memory_utilization is not None:
                activations = activation_peak_bytes(
                    self.target, self.drafter, self.backend, self.device, self.dtype,
                    self.prefill_token_budget, self.max_model_len, config.block_size,
                    config.max_num_seqs, self.num_speculative_tokens + 1)
            self.profiled_activation_bytes = activations
            free, total = torch.cuda.mem_get_info(self.device)  # after the profile's own growth
            budget = kv_cache_budget_bytes(free, total, fraction, activations, field)
            gib = 2**30
            logger.info(
                "KV cache budget %.1f GiB (%s=%s): device %.1f GiB, in use after load %.1f GiB "
                "(torch: %.1f allocated, %.1f reserved), profiled activations %.2f GiB", budget / gib,
                field, fraction, total / gib, (total - free) / gib,
                torch.cuda.memory_allocated(self.device) / gib,
                torch.cuda.memory_reserved(self.device) / gib, activations / gib)
        else:
            budget = _CPU_KV_BUDGET_BYTES
        wanted = blocks_per_seq * config.max_num_seqs
        if fraction is not None and budget // per_block < blocks_per_seq:
            raise ValueError(
                f"{field}={fraction} ({flag(field)}) leaves room for "
                f"{budget // per_block} KV blocks, fewer than one max_model_len="
                f"{self.max_model_len} sequence needs ({blocks_per_seq}); raise it, or lower "
                f"--max-model-len")
        return max(blocks_per_seq, min(wanted, budget // per_block))

    # ---- requests ------------------------------------------------------------------------------

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for: ``config.max_logprobs`` (-1: the whole
        vocabulary), at most the vocabulary."""
        vocab = self.target.spec.vocab_size
        return vocab if self.config.max_logprobs == -1 else min(self.config.max_logprobs, vocab)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> Sequence:
        """Queue a request -> its :class:`Sequence`. ``priority`` (vLLM's; lower goes first)
        needs the ``priority`` scheduling policy unless it is 0. ValueError naming the field
        for anything the engine cannot run."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"priority must be an integer (lower is scheduled first), got {priority!r}")
        if priority != 0 and not self.scheduler.is_priority:
            raise ValueError(f"priority={priority} needs the priority scheduling policy; start the "
                             "engine with scheduling_policy='priority' (--scheduling-policy "
                             "priority), or leave priority at 0")
        if not prompt_token_ids:
            raise ValueError("prompt is empty; pass at least one token")
        vocab = self.target.spec.vocab_size
        bad = [t for t in prompt_token_ids if not (0 <= int(t) < vocab)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.allowed_token_ids or ()) if t >= vocab]
        if bad:
            raise ValueError(f"allowed_token_ids token ids {bad[:5]} are outside the vocabulary [0, "
                             f"{vocab}); allow ids of this model's tokenizer only")
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("SamplingParams.bad_words are words: the engine bans their token ids "
                             "(bad_words_token_ids), which LLM.generate and the server fill with "
                             "the tokenizer (config.tokenize_bad_words); pass them, or use LLM")
        bad = sorted({t for w in params.bad_words_token_ids or () for t in w if t >= vocab})
        if bad:
            raise ValueError(f"bad_words token ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
                             "the tokenizer gives ids this model does not have")
        stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.allowed_token_ids and params.min_tokens and set(params.allowed_token_ids) <= stops:
            # min_tokens bans every stop token before it: no token would be left to generate
            raise ValueError(f"allowed_token_ids {params.allowed_token_ids[:5]} are all stop tokens "
                             f"(EOS unless ignore_eos, stop_token_ids), which min_tokens="
                             f"{params.min_tokens} bans: nothing could be generated; allow another "
                             "token, or drop min_tokens")
        single = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}  # banned everywhere
        if params.allowed_token_ids and set(params.allowed_token_ids) <= single | (
                stops if params.min_tokens else set()):
            raise ValueError(f"allowed_token_ids {params.allowed_token_ids[:5]} are all one-token "
                             "bad_words (banned at every position) or, before min_tokens, stop "
                             "tokens: nothing could be generated; allow another token, or drop "
                             "those words")
        grammar = params.structured_grammar
        if params.structured_outputs is not None and grammar is None:
            raise ValueError("SamplingParams.structured_outputs is enforced through its grammar "
                             "compiled with the tokenizer (structured_grammar), which LLM.generate "
                             "and the server fill; use LLM, or compile it with structured_outputs."
                             "StructuredOutputCompiler")
        if grammar is not None and grammar.vocab_size != vocab:
            raise ValueError(f"SamplingParams.structured_grammar was compiled for a vocabulary of "
                             f"{grammar.vocab_size} tokens, and this model has {vocab}; compile it "
                             "with this model's vocabulary size")
        most = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > most:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)} is more than "
                                 f"max_logprobs={most}; ask for fewer, or raise the engine's "
                                 "max_logprobs (-1: the whole vocabulary)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}; shorten the prompt or raise max_model_len (--max-model-len)"
            )
        seq = Sequence(next(self._ids), [int(t) for t in prompt_token_ids], params,
                       eos_token_ids=self.eos_token_ids, prompt=prompt, priority=int(priority))
        if params.logprobs is not None:
            seq.logprobs = []
        if grammar is not None:  # in a final state the stop tokens are allowed too
            seq.grammar = grammar.matcher(tuple(sorted(stops)))
        self.scheduler.add(seq)
        if self._ops is not None:
            self._ops.append(("add", seq.prompt_token_ids, params, prompt, seq.priority))
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        if self._ops is not None:
            self._ops.append(("abort", seq.request_id))

    # ---- tensor parallelism: rank 0 leads, the other ranks follow --------------------------------
    # An offline script runs on every rank and makes the same calls there (torchrun runs it once
    # per rank). A server takes requests on rank 0 only: it calls lead(), and every other rank
    # calls follow(), which replays rank 0's adds, aborts and steps in order. Every engine
    # decision is a function of those calls and of bits that are equal on every rank (logits,
    # sampled tokens, acceptance; adaptive K observes rank 0's clock), so the followers'
    # schedulers take the same decisions and join the same collectives.

    def lead(self) -> None:
        """Rank 0 of a tensor-parallel server: send every later add, abort and step to the
        ranks in :meth:`follow`."""
        if self.tp.is_parallel:
            assert self.tp.is_driver, "only rank 0 leads"
            self._ops = []

    def stop_followers(self) -> None:
        """Rank 0: let the ranks in :meth:`follow` return (before this process exits)."""
        if self._ops is not None:
            self.tp.broadcast_object(self._ops + [("stop",)])
            self._ops = None

    @torch.inference_mode()  # as the server's engine thread, whose calls this replays
    def follow(self) -> list[Sequence]:
        """Ranks > 0 of a tensor-parallel server: apply rank 0's adds, aborts and steps until it
        calls :meth:`stop_followers` -> the requests that finished here, in order. A step that
        fails fails on rank 0 too (same inputs, same state), whose server then aborts the
        requests it fails: aborts these ranks replay."""
        seqs: dict[int, Sequence] = {}
        finished: list[Sequence] = []
        while True:
            for op in self.tp.broadcast_object(None):
                if op[0] == "add":
                    seq = self.add_request(op[1], op[2], prompt=op[3], priority=op[4])
                    seqs[seq.request_id] = seq
                elif op[0] == "abort":
                    if op[1] in seqs:
                        self.abort(seqs.pop(op[1]))
                elif op[0] == "reset_prefix_cache":
                    self.reset_prefix_cache()
                elif op[0] == "step":
                    try:
                        for s in self.step():
                            finished.append(seqs.pop(s.request_id))
                    except Exception:  # rank 0 fails the same way and sends the aborts
                        logger.exception("engine step failed on rank %d", self.tp.rank)
                elif op[0] == "stop":
                    return finished

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after new weights; vLLM's ``reset_prefix_cache``)."""
        self.scheduler.reset_prefix_cache()
        if self._ops is not None:
            self._ops.append(("reset_prefix_cache",))

    @staticmethod
    def _positions(seqs: list[Sequence]) -> list[int]:
        """Each request's next output position (the tokens it generated so far): its first row's
        seeded noise (engine/sampler.py); a verify's row ``j`` takes the position ``+ j``."""
        return [len(s.output_token_ids) for s in seqs]

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Target logits ``[T, V]`` float32 for every position of one prompt (scoring/debugging).

        Runs one prefill through the paged cache on temporarily borrowed blocks.
        """
        n = len(token_ids)
        need = self.allocator.blocks_needed(n, 0)
        num_tables = 1 + (self.kv_layout.num_swa_groups if self.kv_layout is not None else 0)
        if not self.allocator.can_allocate(need * num_tables):
            raise RuntimeError("no free KV blocks to score the prompt; wait for running requests")
        tables = [self.allocator.allocate(need) for _ in range(num_tables)]  # and each SWA group's
        try:
            with batch_invariant.scope(self.config.batch_invariant):
                hidden, _ = self.runner.forward(token_ids, [ForwardItem(n, 0, n, tables[0], tuple(tables[1:]))])
                return self.target.compute_logits(hidden)
        finally:
            for blocks in tables:
                self.allocator.free(blocks)

    # ---- steps ---------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one scheduled forward; returns the requests that finished in it.

        Raises :class:`StepError` (naming the step's requests) if the forward fails.
        """
        if self._ops is not None:  # the followers run this step with us
            self.tp.broadcast_object(self._ops + [("step",)])
            self._ops = []
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            with batch_invariant.scope(self.config.batch_invariant):
                return self._run(batch)
        except Exception as e:
            raise StepError(list(batch.sequences), e) from e

    def _run(self, batch) -> list[Sequence]:
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None  # for this step only
        if batch.is_prefill:
            self._prefill(batch.sequences, batch.num_new_tokens)
            self.timings.prefill_s += time.perf_counter() - t0
        else:
            seqs = batch.sequences
            k = self.num_speculative_tokens
            if self.k_policy is not None:
                k = self.k_policy.choose(len(seqs))
            if self.proposer is not None and k > 0:
                accepted = self._spec_decode(seqs, k, ahead if isinstance(ahead, DraftsAhead) else None)
            else:
                accepted = self._decode(seqs, ahead if isinstance(ahead, ForwardAhead) else None)
            seconds = time.perf_counter() - t0
            if self.k_policy is not None:
                # rank 0's clock decides for every rank: the policies stay identical, so all
                # ranks choose the same K and queue the same forwards ahead
                self.k_policy.observe(k, len(seqs), accepted, self.tp.broadcast_object(seconds))
            self.timings.decode_s += seconds
            self.timings.num_decode_steps += 1
        self.timings.num_steps += 1
        for s in batch.sequences:  # their full blocks whose K/V became final, for later prompts
            self.scheduler.cache_blocks(s)
            self.scheduler.trim_window(s)  # then the SWA blocks out of every later window
        finished = [s for s in batch.sequences if s.is_finished]
        for s in finished:
            self.scheduler.finish(s)
        return finished

    def _commit(self, seq: Sequence, tokens: list[int], first_row: int,
                logprob_rows: list[tuple[Sequence, int, list[int]]]) -> int:
        """Append ``tokens`` -> how many were kept (fewer once the request finishes: max_tokens,
        a stop token, max_model_len). A request that wants logprobs adds ``(seq, first_row,
        kept tokens)`` to ``logprob_rows``: its tokens' rows of the step's logits start at
        ``first_row``; :meth:`_add_logprobs` then serves every request of the step at once."""
        kept = seq.append_tokens(tokens, self.max_model_len)
        if seq.logprobs is not None:
            logprob_rows.append((seq, first_row, tokens[:kept]))
        return kept

    def _step_tokens(self, hidden: torch.Tensor, seqs: list[Sequence], rows_per_request: int = 1,
                     drafts: torch.Tensor | None = None,
                     ids_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tokens [R * rows_per_request] int64, logits or None)`` of a decode step's or a
        verify's rows ``hidden`` (request-major): with :data:`greedy_int8_lm_head`, a step whose
        requests are all greedy without logprobs or penalties takes the argmax through the
        lm_head's int8 copy and has no logits (and the argmax stores the tokens into ``ids_out``
        too, if given); otherwise the logits and the sampler (``drafts``: the verify's, for the
        penalties), and ``ids_out`` is not written."""
        if greedy_int8_lm_head and self.target.lm_head_int8 is not None and all(
                s.params.is_greedy and s.params.logprobs is None and not s.params.has_penalties
                and len(s.output_token_ids) >= s.params.min_tokens for s in seqs):
            tokens = self.target.greedy_tokens(hidden, also_into=ids_out)
            if tokens is not None:
                return tokens, None
        logits = self.target.lm_head_logits(hidden)
        tokens = sample_rows(logits, [s.params for s in seqs], self._positions(seqs), rows_per_request,
                             replaced=penalized_rows(logits, seqs, rows_per_request, drafts),
                             global_generator=self.generator)
        return tokens, logits

    def _add_logprobs(self, logits: torch.Tensor | None, logprob_rows: list[tuple[Sequence, int, list[int]]]) -> None:
        """Extend each request's ``logprobs`` from ``logits [rows, V]``: one pass and one host
        copy for the whole step (``logprob_rows`` from :meth:`_commit`), not one a request.
        ``logits`` is None only in a step without logprobs (:meth:`_step_tokens`)."""
        if not logprob_rows:
            return
        assert logits is not None, "a step with logprobs computes its logits"
        rows = [r + j for _, r, toks in logprob_rows for j in range(len(toks))]
        entries = iter(top_logprobs(
            logits.index_select(0, to_device_async(torch.tensor(rows), logits.device)),
            torch.tensor([t for _, _, toks in logprob_rows for t in toks]),
            [s.params.logprobs for s, _, toks in logprob_rows for _ in toks]))
        for s, _, toks in logprob_rows:
            s.logprobs += [next(entries) for _ in toks]

    def _prefill(self, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
        """Compute ``num_new_tokens[i]`` tokens of request ``i`` at positions ``num_computed ..``
        (past its cached prefix; a chunk of its prompt with chunked prefill) and store their
        drafter context; a request whose prompt this completes samples its first token."""
        items = [forward_item(s, n, s.num_computed, s.num_computed + n)
                 for s, n in zip(seqs, num_new_tokens)]
        ids = [t for s, n in zip(seqs, num_new_tokens)
               for t in s.token_ids[s.num_computed : s.num_computed + n]]
        hidden, taps = self.runner.forward(ids, items, self.tap_layer_ids)
        starts = [0] + list(itertools.accumulate(num_new_tokens))[:-1]
        if taps is not None:
            # The prompts' drafter context K/V belongs to prefill (vLLM's proposer runs right
            # after the target's prefill): queued before this step's one host sync, so TTFT pays
            # it and the decode steps do not; the taps [sum(n), layers * H] are freed now.
            for s, start, n in zip(seqs, starts, num_new_tokens):
                s.clear_pending_taps()
                s.add_pending_taps(taps, start, n, s.num_computed)
            self.proposer.store_context(seqs)
        for s, start, n in zip(seqs, starts, num_new_tokens):
            if s.params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden[start : start + n])
            s.num_computed += n
        done = [i for i, s in enumerate(seqs) if s.num_computed == s.num_tokens]
        if done:
            last_rows = torch.tensor([starts[i] + num_new_tokens[i] - 1 for i in done])
            logits = self.target.lm_head_logits(hidden[to_device_async(last_rows, self.device)])
            ended = [seqs[i] for i in done]
            tokens = sample_rows(logits, [s.params for s in ended], self._positions(ended),
                                 replaced=penalized_rows(logits, ended), global_generator=self.generator).tolist()
            logprob_rows = []
            for j, s in enumerate(ended):
                self._commit(s, [tokens[j]], j, logprob_rows)
            self._add_logprobs(logits, logprob_rows)
        self.timings.num_prefill_tokens += len(ids)

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Extend ``seq.prompt_logprobs`` with this prefill's rows ``hidden [n, H]`` (positions
        ``num_computed ..``): row ``j`` scores prompt token ``j + 1``; entry 0 is None. A
        preempted request's recompute finds them complete."""
        c, prompt = seq.num_computed, seq.prompt_token_ids
        if seq.prompt_logprobs is None:
            assert c == 0, "prompt logprobs need the whole prompt computed"
            seq.prompt_logprobs = [None]
        if len(seq.prompt_logprobs) != c + 1:
            return  # complete (a recompute after preemption)
        end = min(c + hidden.shape[0], len(prompt) - 1)  # positions c .. end - 1 score tokens up to end
        if end > c:
            rows = self.target.compute_logits(hidden[: end - c])
            seq.prompt_logprobs += top_logprobs(rows, torch.tensor(prompt[c + 1 : end + 1]),
                                                seq.params.prompt_logprobs)

    def _decode(self, seqs: list[Sequence], ahead: ForwardAhead | None = None) -> list[int]:
        """One target-only token per request (its forward possibly queued by the previous step,
        ``ahead``; with ``decode_ahead`` this step queues the next one's). With a drafter loaded
        (K = 0: fixed, or adaptive K's choice) the taps of the committed token join the pending
        taps (a row
        reference, no tensor op per request), so the drafter's KV stays complete for the next
        speculative step; pending taps reaching K_max + 1 rows are stored right away (the size
        the context graphs take), so a long run of target-only steps neither holds them without
        bound nor falls back to the eager precompute, and the store is amortised over K_max + 1
        steps."""
        # the forward queued ahead, if it computed this step's tokens (with taps iff we tap)
        fits = ahead is not None and (ahead.taps is not None) == bool(self.tap_layer_ids)
        rows = ahead.rows_for(seqs) if fits else None
        if rows is None:
            items = [forward_item(s, 1, s.num_tokens - 1, s.num_tokens) for s in seqs]
            hidden, taps = self.runner.forward([s.last_token for s in seqs], items, self.tap_layer_ids,
                                               copy_hidden=False)  # consumed by the lm_head below
            tap_rows = range(len(seqs))
        else:
            taps, tap_rows = ahead.taps, rows  # pending taps reference rows of the ahead's taps
            hidden = (ahead.hidden if rows == list(range(len(ahead.request_ids)))
                      else ahead.hidden.index_select(0, to_device_async(torch.tensor(rows), self.device)))
        plan = self._plan_forward_ahead(seqs) if self._queues_forward_ahead(len(seqs)) else None
        staged = plan.staged if plan is not None else None
        sampled, logits = self._step_tokens(hidden, seqs, ids_out=staged.ids if staged is not None else None)
        if plan is not None:  # the wait excludes the forward queued ahead
            result = HostCopy(sampled)
            # logits None: the int8 argmax ran, and wrote the tokens into staged.ids too
            self._ahead = self._queue_forward_ahead(plan, staged.ids if staged is not None and logits is None
                                                    else sampled)
            tokens = result.tolist()
        else:
            tokens = sampled.tolist()
        num_kept, logprob_rows = 0, []
        for i, s in enumerate(seqs):
            if taps is not None:  # this request's row of the taps: referenced, no tensor op
                s.add_pending_taps(taps, tap_rows[i], 1, s.num_tokens - 1)
            s.num_computed = s.num_tokens
            num_kept += self._commit(s, [tokens[i]], i, logprob_rows)
        self._add_logprobs(logits, logprob_rows)
        if taps is not None:
            max_rows = self.proposer.num_speculative_tokens + 1  # K_max + 1, whatever K is now
            full = [s for s in seqs if s.num_pending >= max_rows]
            if full:
                self.proposer.store_context(full)
        self.timings.num_decode_tokens += num_kept
        return []

    def _queues_forward_ahead(self, batch_size: int) -> bool:
        """Whether this target-only step queues the next one's forward (``decode_ahead``): the
        next step of an engine with a drafter must be target-only too. Not while a chunked
        prefill is in progress: the next step is its chunk, and the forward would be dropped."""
        on = decode_ahead if decode_ahead is not None else self.runner.graphs is not None
        on = on and not self.scheduler.prefilling
        if not on or self.proposer is None:
            return on
        if self.k_policy is not None:
            return self.k_policy.expects_target_only(batch_size)
        return self.num_speculative_tokens == 0

    def _plan_forward_ahead(self, seqs: list[Sequence]) -> PlannedForward | None:
        """The next step's target forward, before this step's tokens exist: request ``i`` at
        position ``num_tokens`` (its block table grown to hold it; no preemption: when blocks are
        short, nothing is queued), its rows uploaded now where a graph runs it
        (:data:`stage_forward_ahead`). None when every request ends with this step's token."""
        if all(len(s.output_token_ids) + 1 >= s.params.max_tokens for s in seqs):
            return None
        positions = [s.num_tokens for s in seqs]
        if not all(self.scheduler.reserve(s, p + 1) for s, p in zip(seqs, positions)):
            return None
        items = [forward_item(s, 1, p, p + 1) for p, s in zip(positions, seqs)]
        staged = self.runner.stage_decode(items, self.tap_layer_ids) if stage_forward_ahead else None
        return PlannedForward(tuple(s.request_id for s in seqs), positions, items, staged)

    def _queue_forward_ahead(self, plan: PlannedForward, sampled: torch.Tensor) -> ForwardAhead:
        """Queue the planned forward with this step's tokens ``sampled [R]`` (device) as ids."""
        # hidden: a view of the graph's output, valid until the runner's next replay; the next
        # step queues its lm_head before any (it runs its own forward where this one does not
        # fit, and a step that is no decode drops it)
        if plan.staged is not None:
            hidden, taps = self.runner.run_staged(plan.staged, sampled, copy_hidden=False)
        else:
            hidden, taps = self.runner.forward(sampled, plan.items, self.tap_layer_ids, copy_hidden=False)
        return ForwardAhead(plan.request_ids, plan.positions, hidden, taps)

    def _queue_drafts_ahead(self, seqs: list[Sequence], k: int, anchors: list[int],
                            accepted: torch.Tensor, target_tokens: torch.Tensor,
                            taps: torch.Tensor | None) -> DraftsAhead | None:
        """Queue the next step's drafter block from this step's device results (``accepted
        [R]``, ``target_tokens [R, k + 1]``): request ``i`` continues at ``P_i + a_i + 1 <=
        P_i + k + 1`` with bonus ``t_{a_i}``. Its KV blocks are grown to cover that block first
        (no preemption: when blocks are short, nothing is queued). Not while a chunked prefill
        is in progress (the next step is its chunk)."""
        if (not draft_ahead or taps is not None or self.proposer.runner.graphs is None
                or self.scheduler.prefilling or any(s.grammar for s in seqs)):
            return None  # a constrained request's drafts are chosen on the host (propose)
        # the next block ends at P + a + 1 + k <= P + 2k + 1
        if not all(self.scheduler.reserve(s, p + 2 * k + 2) for s, p in zip(seqs, anchors)):
            return None
        return self.proposer.propose_ahead(seqs, k, anchors, accepted, target_tokens)

    def _simulated_accept(self, k: int) -> int:
        """Accepted drafts for a simulated mean acceptance length L: ``L - 1`` on average, as
        integers (a running remainder carries the fraction), capped at ``k``."""
        want = self.simulated_acceptance - 1.0 + self._sim_carry
        a = int(want)
        self._sim_carry = want - a
        return max(0, min(k, a))

    def _simulated_counts(self, counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``counts`` as a ``[R]`` int64 device tensor, uploaded once per distinct tuple: with
        an integer L every step repeats one tuple, so a simulated step pays no upload (a real
        one has none: its counts come from the verify) and times what real acceptance would."""
        cached = self._sim_counts_on_device.get(counts)
        if cached is None:
            if len(self._sim_counts_on_device) >= 64:  # fractional L over changing batches
                self._sim_counts_on_device.clear()
            cached = self._sim_counts_on_device[counts] = to_device_async(torch.tensor(counts), device)
        return cached

    def _spec_decode(self, seqs: list[Sequence], k: int, ahead: DraftsAhead | None = None) -> list[int]:
        """One DFlash step for the whole batch with ``k`` drafts each: draft (or take the drafts
        the previous step queued, ``ahead``), verify, accept, queue the next step's drafts,
        commit, roll back. Returns the accepted-draft count per request."""
        if ahead is not None and ahead.fits(seqs, k) and not any(s.grammar for s in seqs):
            drafts = ahead.drafts  # [R, k]
        else:
            drafts = self.proposer.propose(seqs, k)
        anchors = [s.num_tokens - 1 for s in seqs]  # position P of each bonus token
        # No host sync between draft and verify: the host prepares the verify launch while the
        # drafter runs. The bonus tokens go up with the request rows; the drafts (placeholders
        # 0 here) are copied device to device after them
        ids = [0] * (len(seqs) * (k + 1))
        ids[:: k + 1] = [s.last_token for s in seqs]
        items = [forward_item(s, k + 1, p, p + k + 1) for p, s in zip(anchors, seqs)]
        hidden, taps = self.runner.forward(ids, items, self.tap_layer_ids, store_context=store_context_in_verify,
                                           tail_ids=drafts, copy_hidden=False)  # consumed by the lm_head
        # logits [R*(K+1), V] in the weights' dtype, or None (greedy tokens from the int8 copy).
        # Penalties: row j counts drafts d_1..d_j as outputs (engine/penalties.py: lossless).
        # Seeded requests: row j takes the noise of output position len(output) + j, the one a
        # target-only step would use there (engine/sampler.py), whichever rows are accepted
        target_tokens, logits = self._step_tokens(hidden, seqs, k + 1, drafts)
        target_tokens = target_tokens.view(len(seqs), k + 1)
        simulated = None
        if self.simulated_acceptance is not None:  # on the device too: the drafts ahead use it
            simulated = self._simulated_counts(tuple(self._simulated_accept(k) for _ in seqs), drafts.device)
        # the accepted counts (given when simulated) and the rows of the host copy, in one launch
        # where Triton runs (kernels/accept_pack.py); accepted [R] int64, contiguous
        packed, accepted = accept_and_pack(drafts, target_tokens, simulated)
        # One host sync per step, after the device work: bring back what commits need, in one
        # copy (packed [R, 1 + (K+1) + K] int64: accepted count, target tokens, drafts). The next
        # step's drafter block is queued behind the copy, so the wait below does not include it.
        result = HostCopy(packed)
        ahead = self._queue_drafts_ahead(seqs, k, anchors, accepted, target_tokens, taps)
        rows = result.tolist()
        accepted_list = [row[0] for row in rows]
        target_list = [row[1 : k + 2] for row in rows]
        draft_list = [row[k + 2 :] for row in rows]
        if ahead is not None:
            ahead.anchors = [p + a + 1 for p, a in zip(anchors, accepted_list)]
            self._ahead = ahead
        logprob_rows = []  # logits [R * (K+1), V]: request i's rows from i * (K+1)
        max_k, is_traced, num_kept = self.num_speculative_tokens, self.config.trace, 0
        for i, s in enumerate(seqs):
            a, p = accepted_list[i], anchors[i]
            s.num_drafts += 1
            s.num_draft_tokens += k
            s.num_accepted_tokens += a
            per_pos = s.num_accepted_tokens_per_pos
            if len(per_pos) < max_k:
                per_pos += [0] * (max_k - len(per_pos))
            for j in range(a):
                per_pos[j] += 1
            self.spec_stats.observe(a, k)
            if is_traced:
                s.trace.append({"anchor_position": p, "draft_tokens": draft_list[i], "num_accepted": a})
            # Committed: the bonus and the a accepted drafts (positions P..P+a) now have target
            # KV (and drafter context: stored by the verify, or pending below). Rows beyond are
            # rolled back by length: they stay in the cache, invisible, and are overwritten.
            s.num_computed = p + a + 1
            if taps is not None:  # rows of taps [R * (K+1), D]
                s.clear_pending_taps()
                s.add_pending_taps(taps, i * (k + 1), a + 1, p)
            # emitted = accepted drafts + the target's token after them (with real acceptance
            # d_j == t_{j-1}, so this is t_0..t_a; with simulated acceptance it keeps the
            # committed tokens equal to the verified rows whose KV is kept)
            # the decode tokens delivered: a + 1, fewer where the request finished inside them
            num_kept += self._commit(s, draft_list[i][:a] + [target_list[i][a]], i * (k + 1), logprob_rows)
        self.timings.num_decode_tokens += num_kept
        self._add_logprobs(logits, logprob_rows)
        return accepted_list
