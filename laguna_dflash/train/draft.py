"""``laguna-dflash train-draft``: distil a DFlash drafter for a frozen target.

Recipe (reference/dflash.md section 6): the target (embeddings and lm_head shared and frozen)
regenerates the data as its own greedy continuations of corpus prompts; one target forward over
each whole sequence gives the taps; per sequence, random anchors ``a`` in the generated part;
block input ``[x_a, MASK x (S-1)]`` at positions ``a .. a+S-1``; the block attends to context
strictly before its anchor plus its own block (causal inside the block for a causal drafter);
slot ``k`` is labelled with ``x_{a+k}`` (same-position labels) and weighted ``exp(-(k-1)/gamma)``.
Checkpoints are written in the Poolside (Laguna flavour) or z-lab (Qwen3 flavour) format.

Data parallel under torchrun (``torchrun --nproc-per-node N -m laguna_dflash train-draft ...``):
every rank holds the frozen target and a drafter replica, regenerates ``1/N`` of the data,
draws the same global batch and anchors, and computes its ``batch_size / N`` rows' part of the
loss (normalised by the whole batch's weight); the gradients are summed over the ranks, so N
ranks take the optimizer steps one process would take on the whole batch. With cached target
states each rank keeps ``1/N`` of them and fetches the rest of its rows from the others.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import resolve_device
from ..distributed import SINGLE, TensorParallel
from ..engine.attention import AttentionMetadata
from ..models.dflash import (
    DFlashDraftModel,
    dflash_value,
    qwen3_draft_spec,
    resolve_target_layer_ids,
)
from ..models.laguna_dflash import DFlashLaguna, laguna_draft_spec
from ..models.layers import ForwardContext
from ..models.loader import CheckpointError, load_model, read_config
from ..models.random_init import randomize_
from ..models.registry import DRAFT_ARCHITECTURES
from ..models.writer import save_checkpoint
from .backend import BlockTrainingBackend, DenseTrainingBackend, dense_metadata
from .common import (
    arg,
    autocast,
    check_device,
    check_out_dir,
    join_data_parallel,
    make_work_dir,
    require_at_least,
    require_positive,
    run_training,
    seed_everything,
    shared_arg,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftTrainConfig:
    target: str = arg("the target checkpoint folder the drafter learns from (its embeddings and "
                      "lm_head are shared, not trained)")
    out_dir: str = arg("folder for the drafter checkpoint; its work/ subfolder keeps the "
                       "regenerated data and the resumable training state")
    flavour: str = arg("on-disk format: laguna (Poolside's DFlashLagunaForCausalLM) or qwen3 "
                       "(z-lab's DFlashDraftModel)", "laguna")
    num_layers: int = arg("drafter decoder layers", 2)
    block_size: int = arg("tokens a block: the last accepted token plus block_size - 1 draft tokens",
                          16)
    num_taps: int | None = arg("target layers whose hidden states feed the drafter, evenly spaced "
                               "(default: 3, fewer on a shallower target)", None)
    num_anchors: int = arg("blocks a training sequence, each starting at a random position of the "
                           "generated part", 32)
    gamma: float = arg("slot k's loss weight is exp(-(k - 1) / gamma): larger weighs late draft "
                       "tokens more", 7.0)
    distill: bool = arg("soft labels (the target's distribution at each position) instead of its "
                        "greedy tokens", True)
    mask_token_id: int | None = arg("the token id that fills the block's draft slots (default: the "
                                    "target config's mask_token_id)", None)
    prompt_len: int = arg("corpus tokens a regenerated sequence starts from", 64)
    gen_len: int = arg("tokens the target generates greedily after each prompt; the drafter "
                       "trains on these", 192)
    num_sequences: int = arg("sequences to regenerate", 2048)
    batch_size: int = shared_arg("batch_size", 16)
    steps: int = shared_arg("steps", 2000)
    lr: float = shared_arg("lr", 1e-3)
    warmup: int = shared_arg("warmup", 100)
    seed: int = arg("seed of the weights, prompts, batches and anchors", 0)
    device: str = shared_arg("device", "cpu")
    gen_batch_size: int = arg("sequences the target generates at once while regenerating", 256)
    corpus_tokens: str | None = arg("a .npy token stream to cut prompts from (default: "
                                    "TARGET/work/train_tokens.npy, left by train-target)", None)
    regen_budget_s: float | None = arg("stop regenerating after this many seconds and train on the "
                                       "sequences done so far", None)
    init_from: str | None = arg("start from this drafter checkpoint (its config wins: a --flavour, "
                                "--num-layers, --block-size, --num-taps or --mask-token-id that "
                                "differs from it is an error) instead of random weights", None)
    cache_target_states: bool = arg("run the frozen target once over the data and keep its tapped "
                                    "states in host memory, instead of every step", False)
    save_every: int = shared_arg("save_every", 500)
    log_every: int = shared_arg("log_every", 50)
    time_budget_s: float | None = shared_arg("time_budget_s", None)

    def __post_init__(self) -> None:
        if self.flavour not in ("laguna", "qwen3"):
            raise ValueError(f"--flavour must be 'laguna' or 'qwen3', got {self.flavour!r}")
        require_at_least(self, num_layers=1, block_size=2, num_taps=1, num_anchors=1, mask_token_id=0,
                          prompt_len=1, gen_len=1, num_sequences=1, batch_size=1, steps=1, warmup=0,
                          gen_batch_size=1, save_every=1, log_every=1)
        require_positive(self, "gamma", "lr", "regen_budget_s", "time_budget_s")
        check_device(self.device)


#: Fields a resumed ``train-draft`` may change (the rest must equal the interrupted run's):
#: where it runs and reports, how long, and how the data (kept in ``work/regenerated.npy``) and
#: the first weights (replaced by the state's) were made.
RESUMABLE_DRAFT_FIELDS = frozenset({
    "target", "out_dir", "steps", "device", "save_every", "log_every", "time_budget_s",
    "gen_batch_size", "regen_budget_s", "corpus_tokens", "num_sequences", "init_from",
    "cache_target_states"})

#: Target layers tapped when ``--num-taps`` is not given (fewer on a target too shallow for them).
DEFAULT_NUM_TAPS = 3


def default_taps(depth: int, n: int, flavour: str = "laguna") -> list[int]:
    """``n`` evenly spaced target layers to tap, from layer 1 (distinct: fewer on a shallow
    target). The laguna flavour ends at the last layer, pre-final-norm, as Poolside's published
    drafters do. The qwen3 flavour follows z-lab's ``build_target_layer_ids`` (1 to ``L - 3``;
    e.g. L = 32, n = 5 -> [1, 8, 15, 22, 29]): the reference's loop reads transformers' hidden
    states, which are normed at the last layer, so a drafter trained on the pre-norm last layer
    would see other inputs there. On a target of under 5 layers it ends at ``L - 2`` (not the
    last layer while ``L >= 3``)."""
    if n == 1:
        return [depth // 2]
    last = depth - 1 if flavour == "laguna" else max(1, depth - 3 if depth >= 5 else depth - 2)
    return sorted({round(1 + i * (last - 1) / (n - 1)) for i in range(n)})


def draft_config(c: DraftTrainConfig, target_cfg: dict) -> dict:
    """config.json of the drafter, in the chosen flavour's on-disk schema."""
    hidden = target_cfg["hidden_size"]
    head_dim = target_cfg.get("head_dim", 64)
    taps = default_taps(target_cfg["num_hidden_layers"], c.num_taps or DEFAULT_NUM_TAPS, c.flavour)
    mask_id = c.mask_token_id if c.mask_token_id is not None else target_cfg.get("mask_token_id")
    if mask_id is None:
        raise ValueError("the target config has no mask_token_id; pass --mask-token-id (a reserved row)")
    dflash = {"block_size": c.block_size, "mask_token_id": int(mask_id),
              "num_target_layers": target_cfg["num_hidden_layers"], "target_layer_ids": taps}
    common = {
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": c.num_layers,
        "num_attention_heads": 2 * hidden // head_dim, "num_key_value_heads": 2, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "max_position_embeddings": target_cfg.get("max_position_embeddings", 4096),
        "vocab_size": target_cfg["vocab_size"], "hidden_act": "silu", "attention_bias": False,
    }
    if c.flavour == "laguna":
        return {**common, "architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna",
                "rope_theta": 500000.0, "sliding_window": target_cfg.get("sliding_window", 512),
                "layer_types": ["sliding_attention"] * c.num_layers, "gating": "per-head",
                "num_experts": 0, "draft_vocab_size": target_cfg["vocab_size"],
                "eagle_aux_hidden_state_layer_ids": [t + 1 for t in taps],
                "dflash_config": {**dflash, "causal": True}}
    if c.flavour == "qwen3":
        return {**common, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                "rope_theta": 1000000.0, "num_target_layers": target_cfg["num_hidden_layers"],
                "dflash_config": dflash}
    raise ValueError(f"--flavour must be 'laguna' or 'qwen3', got {c.flavour!r}")


def regenerate(c: DraftTrainConfig, work: Path, dp: TensorParallel = SINGLE) -> torch.Tensor:
    """``[N, prompt_len + gen_len]`` int64: corpus prompts + the target's greedy continuations.
    Data parallel: rank ``r`` continues prompts ``r, r + N, ...`` on its device; rank 0 joins
    the parts (rank by rank) into the one cache every rank loads."""
    cache = work / "regenerated.npy"
    reused = cache.is_file()
    if not reused:
        part = _regenerate_part(c, work, dp)
        if dp.is_parallel:
            np.save(work / f"regenerated.rank{dp.rank}.npy", part)
            dp.barrier()
            if dp.is_driver:
                parts = [work / f"regenerated.rank{r}.npy" for r in range(dp.world_size)]
                np.save(cache, np.concatenate([np.load(p) for p in parts]))
                for p in parts:
                    p.unlink()
        else:
            np.save(cache, part)
    dp.barrier()
    rows = np.load(cache)
    if rows.ndim != 2 or rows.shape[1] != c.prompt_len + c.gen_len:
        raise ValueError(
            f"{cache} holds rows of shape {list(rows.shape[1:])}, not the "
            f"--prompt-len {c.prompt_len} + --gen-len {c.gen_len} = {c.prompt_len + c.gen_len} "
            "tokens of this run (a run with other lengths made it): delete it to regenerate, or "
            "pass the lengths it was made with")
    if reused and rows.shape[0] != c.num_sequences and dp.is_driver:
        logger.warning("%s (from an earlier run) holds %d sequences, not --num-sequences %d: "
                       "training on them; delete it to regenerate", cache, rows.shape[0],
                       c.num_sequences)
    return torch.from_numpy(rows.astype(np.int64))


def _regenerate_part(c: DraftTrainConfig, work: Path, dp: TensorParallel) -> np.ndarray:
    """This rank's part of :func:`regenerate`: ``[n, prompt_len + gen_len]`` int32."""
    from ..config import SamplingParams
    from ..llm import LLM

    stream = corpus_stream(c).astype(np.int64)
    rng = np.random.default_rng(c.seed)
    starts = rng.integers(0, len(stream) - c.prompt_len, size=c.num_sequences)
    prompts = [stream[s : s + c.prompt_len].tolist() for s in starts][dp.rank :: dp.world_size]
    dtype = "bfloat16" if c.device.startswith("cuda") else "float32"
    llm = LLM(c.target, dtype=dtype, device=c.device, max_num_seqs=c.gen_batch_size,
              max_model_len=c.prompt_len + c.gen_len + 1)
    params = SamplingParams(temperature=0, max_tokens=c.gen_len, ignore_eos=True)
    rows = []
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(prompts), c.gen_batch_size), desc="regenerate",
                  disable=not dp.is_driver):
        if rows and c.regen_budget_s and time.perf_counter() - t0 > c.regen_budget_s:
            logger.warning("regeneration budget reached: %d of %d sequences", len(rows), len(prompts))
            break
        chunk = prompts[i : i + c.gen_batch_size]
        outs = llm.generate(prompt_token_ids=chunk, sampling_params=params)
        rows += [p + o.token_ids for p, o in zip(chunk, outs)]
    del llm
    return np.asarray(rows, dtype=np.int32).reshape(len(rows), c.prompt_len + c.gen_len)


def corpus_stream(c: DraftTrainConfig, vocab_size: int | None = None) -> np.ndarray:
    """The corpus token stream the prompts are cut from (memory-mapped), checked: a 1-D integer
    array longer than ``--prompt-len`` (with ``vocab_size``: of ids inside it)."""
    path = Path(c.corpus_tokens) if c.corpus_tokens else Path(c.target) / "work" / "train_tokens.npy"
    if not path.is_file():
        if c.corpus_tokens:
            raise ValueError(f"--corpus-tokens {path}: no such file; pass a .npy token stream (a "
                             "1-D integer array of the target's token ids)")
        raise ValueError(f"no corpus token stream at {path} (train-target leaves one there); pass "
                         "--corpus-tokens FILE.npy")
    try:
        stream = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ValueError(f"--corpus-tokens {path} is not a .npy token array ({e})") from e
    if stream.ndim != 1 or stream.dtype.kind not in "iu":
        raise ValueError(f"--corpus-tokens {path} must hold a 1-D integer token array, got "
                         f"{stream.dtype} of shape {stream.shape}")
    if len(stream) <= c.prompt_len:
        raise ValueError(f"--corpus-tokens {path} holds {len(stream)} tokens, too few for --prompt-len "
                         f"{c.prompt_len}")
    if vocab_size is not None and (int(stream.max()) >= vocab_size or int(stream.min()) < 0):
        raise ValueError(f"--corpus-tokens {path} holds token ids outside the target's vocabulary [0, "
                         f"{vocab_size}); encode it with the target's tokenizer")
    return stream


#: ``--flavour`` of each drafter architecture an ``--init-from`` checkpoint may hold.
FLAVOUR_OF_ARCHITECTURE = {"DFlashLagunaForCausalLM": "laguna", "DFlashDraftModel": "qwen3",
                           "DFlashQwen3ForCausalLM": "qwen3"}


def check_init_from(c: DraftTrainConfig, init_cfg: dict, target_cfg: dict) -> None:
    """An ``--init-from`` drafter (config ``init_cfg``) fits ``--target`` (its width, its
    tapped layers) and no drafter flag given with it asks for another shape: its config wins,
    so a ``--block-size`` (``--num-layers``, ``--flavour``, ``--num-taps``, ``--mask-token-id``)
    other than its own would be ignored. Checked from the config files, before the (long)
    regeneration; a ValueError naming the flag otherwise."""
    where = f"--init-from {c.init_from}"
    arch = init_cfg["architectures"][0]
    width = target_cfg.get("hidden_size")
    for key in ("hidden_size", "target_hidden_size"):
        value = init_cfg.get(key)
        if value is not None and isinstance(width, int) and value != width:
            raise ValueError(f"{where}: its config.json {key} {value} differs from --target's "
                             f"hidden_size {width}; it was trained for another target: pass a "
                             "drafter of this target (or leave --init-from out)")
    depth = target_cfg.get("num_hidden_layers")
    try:
        taps = resolve_target_layer_ids(init_cfg, arch) or []
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if isinstance(depth, int) and any(not 0 <= t < depth for t in taps):
        raise ValueError(f"{where}: it taps target layers {taps}, not all inside --target's {depth} "
                         "layers; it was trained for another target: pass a drafter of this target")
    defaults = {f.name: f.default for f in fields(DraftTrainConfig)}
    own = {"flavour": FLAVOUR_OF_ARCHITECTURE.get(arch),
           "num_layers": init_cfg.get("num_hidden_layers"),
           "block_size": dflash_value(init_cfg, "block_size"),
           "num_taps": len(taps) if taps else None,
           "mask_token_id": dflash_value(init_cfg, "mask_token_id")}
    for name, value in own.items():
        given = getattr(c, name)
        if given != defaults[name] and value is not None and given != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {given} contradicts {where}, a drafter of {flag} {value} "
                             "(a continued drafter keeps its checkpoint's config): drop "
                             f"{flag}, or leave --init-from out to train a new drafter")


def check_inputs(c: DraftTrainConfig, work: Path) -> dict:
    """Check the paths and the target-dependent flags before any regeneration or training ->
    the target's config.json."""
    try:
        target_cfg = read_config(c.target)
    except CheckpointError as e:
        raise ValueError(f"--target {c.target}: {e}") from e
    arch = target_cfg["architectures"][0]
    if arch in DRAFT_ARCHITECTURES:
        raise ValueError(f"--target {c.target} holds a drafter ({arch}); pass the target checkpoint")
    if c.init_from:
        try:
            init_cfg = read_config(c.init_from)
        except CheckpointError as e:
            raise ValueError(f"--init-from {c.init_from}: {e}") from e
        init_arch = init_cfg["architectures"][0]
        if init_arch not in DRAFT_ARCHITECTURES:
            raise ValueError(f"--init-from {c.init_from} holds {init_arch}, not a DFlash drafter; pass "
                             "a drafter checkpoint (or leave it out to start from random weights)")
        check_init_from(c, init_cfg, target_cfg)
    else:
        mask_id = c.mask_token_id if c.mask_token_id is not None else target_cfg.get("mask_token_id")
        if mask_id is None:
            raise ValueError("the target config has no mask_token_id; pass --mask-token-id (a reserved row)")
        vocab = target_cfg.get("vocab_size")
        if isinstance(vocab, int) and not (isinstance(mask_id, int) and 0 <= mask_id < vocab):
            raise ValueError(f"--mask-token-id {mask_id} is outside the target's vocabulary [0, {vocab}); "
                             "pass a reserved row of it")
    depth = target_cfg.get("num_hidden_layers")
    if (c.num_taps is not None and not c.init_from and isinstance(depth, int)
            and len(default_taps(depth, c.num_taps, c.flavour)) < c.num_taps):
        raise ValueError(f"--num-taps {c.num_taps}: the target's {depth} layers give "
                         f"{len(default_taps(depth, c.num_taps, c.flavour))} distinct evenly spaced taps at most "
                         "here; lower --num-taps")
    max_pos = target_cfg.get("max_position_embeddings")
    if isinstance(max_pos, int) and c.prompt_len + c.gen_len > max_pos:
        raise ValueError(f"--prompt-len {c.prompt_len} + --gen-len {c.gen_len} exceeds the target's "
                         f"max_position_embeddings {max_pos}; lower them")
    if not (work / "regenerated.npy").is_file():
        vocab = target_cfg.get("vocab_size")
        corpus_stream(c, vocab if isinstance(vocab, int) else None)
    return target_cfg


def block_metadata(positions: torch.Tensor, is_causal: bool) -> AttentionMetadata:
    """Only ``positions`` and causality are read by the block-training backend."""
    dummy = positions.new_zeros(1, 1)
    return AttentionMetadata(positions=positions, slot_mapping=positions, flat_index=positions,
                             query_index=dummy, query_positions=dummy, key_slots=dummy,
                             seq_lens=dummy[0], is_causal=is_causal)


@torch.no_grad()
def target_states(target, seqs: torch.Tensor, tap_layer_ids,
                  meta: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over ``seqs [B, T]``: (last hidden ``[B*T, H]``, taps ``[B*T, n*H]``)."""
    b, t = seqs.shape
    meta = meta if meta is not None else dense_metadata(b, t, seqs.device)
    ctx = ForwardContext(meta, [(None, None)] * len(target.layers), DenseTrainingBackend())
    return target(seqs.reshape(-1), ctx, tap_layer_ids)


def cached_target_states(target, data: torch.Tensor, tap_layer_ids, device: torch.device,
                         chunk: int = 64, dp: TensorParallel = SINGLE) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_states`` of every sequence of ``data [N, T]``, kept on the CPU (bf16 when the
    target runs on CUDA under autocast, float32 on CPU): (``[N, T, H]``, ``[N, T, n*H]``).
    Costs one target pass instead of one per step. Data parallel: rank ``r`` of ``W`` computes
    and keeps sequences ``r, r + W, ...`` only (sequence ``i`` at row ``i // W``), so the ranks
    share the pass and the memory; :func:`batch_states` fetches a batch's rows from them."""
    if data.shape[0] < dp.world_size:  # a rank would keep no sequence (and fetch from none)
        raise ValueError(f"--cache-target-states over {data.shape[0]} sequences on "
                         f"{dp.world_size} ranks: each rank keeps a share; use --num-sequences "
                         f">= {dp.world_size}, or drop --cache-target-states")
    data = data[dp.rank :: dp.world_size]
    store = torch.bfloat16 if device.type == "cuda" else torch.float32
    hiddens, taps = [], []
    for i in tqdm(range(0, data.shape[0], chunk), desc="target states", disable=not dp.is_driver):
        seqs = data[i : i + chunk].to(device)
        with autocast(device):
            h, x = target_states(target, seqs, tap_layer_ids)
        hiddens.append(h.to("cpu", store).view(*seqs.shape, -1))
        taps.append(x.to("cpu", store).view(*seqs.shape, -1))
    return torch.cat(hiddens), torch.cat(taps)


def batch_states(cache: tuple[torch.Tensor, torch.Tensor], idx: torch.Tensor, rows: slice,
                 dp: TensorParallel = SINGLE) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached target states of sequences ``idx[rows]``: this rank's rows of a global batch
    ``idx [B]`` (int64, drawn alike on every rank; rank ``r`` takes ``rows``, the ``r``-th of
    ``W`` equal slices). ``cache``: this rank's :func:`cached_target_states`. Sequences other
    ranks keep come from them, one message per pair of ranks each way: every rank sends the
    rows it keeps of each other rank's slice. -> (``[B/W, T, H]``, ``[B/W, T, n*H]``), the
    cache's dtype."""
    hidden, taps = cache
    if not dp.is_parallel:
        return hidden[idx[rows]], taps[idx[rows]]
    me, share = dp.rank, rows.stop - rows.start
    owner, local = idx % dp.world_size, idx // dp.world_size

    def kept(js: torch.Tensor) -> torch.Tensor:  # [len(js), T, H + n*H]: batch rows kept here
        return torch.cat((hidden[local[js]], taps[local[js]]), dim=-1)

    row_shape = (hidden.shape[1], hidden.shape[2] + taps.shape[2])
    outgoing, incoming = {}, {}
    for peer in range(dp.world_size):
        if peer != me:
            theirs = torch.arange(peer * share, (peer + 1) * share)
            if (theirs_here := theirs[owner[theirs] == me]).numel():
                outgoing[peer] = kept(theirs_here)
            if num_rows := int((owner[rows] == peer).sum()):
                incoming[peer] = hidden.new_empty((num_rows, *row_shape))
    dp.exchange(outgoing, incoming)
    out = hidden.new_empty((share, *row_shape))
    for peer in range(dp.world_size):  # each peer's rows arrive in batch order
        at = (owner[rows] == peer).nonzero().view(-1)
        if at.numel():
            out[at] = kept(rows.start + at) if peer == me else incoming[peer]
    return out[..., : hidden.shape[2]], out[..., hidden.shape[2] :]


def draw_anchors(c: DraftTrainConfig, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, num_anchors]`` sorted block anchors in the generated part of each sequence, so
    that labels are the target's own continuation: distinct within a row, as the recipe samples
    them (a repeated anchor only counted its block twice), unless the row has fewer positions
    than ``num_anchors``, where they are drawn with repeats."""
    low, high = c.prompt_len - 1, seq_len - 2
    span = high - low + 1
    if span >= c.num_anchors:  # a random subset per row: the first num_anchors of a permutation
        picks = torch.rand(batch, span, generator=gen).argsort(dim=1)[:, : c.num_anchors] + low
    else:
        picks = torch.randint(low, high + 1, (batch, c.num_anchors), generator=gen)
    return picks.sort(dim=1).values


def slot_weights(c: DraftTrainConfig, anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """``[B * num_anchors * (S-1)]`` float32: slot ``k``'s loss weight ``exp(-(k-1)/gamma)``,
    0 where its label would lie past the sequence."""
    slot = torch.arange(1, block_size, device=anchors.device)
    valid = ((anchors.unsqueeze(-1) + slot) < seq_len).reshape(-1).float()
    return torch.exp(-(slot.float() - 1) / c.gamma).repeat(anchors.numel()) * valid


def draft_loss(drafter, target, seqs: torch.Tensor, c: DraftTrainConfig, gen: torch.Generator,
               states: tuple[torch.Tensor, torch.Tensor] | None = None,
               anchors: torch.Tensor | None = None,
               weight_total: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted same-position CE of the drafter on ``seqs [B, T]`` (see module docstring).

    ``states``: the target's (last hidden, taps) for ``seqs`` if already computed (see
    ``cached_target_states``); otherwise the target runs here. ``anchors [B, num_anchors]``:
    given (data parallel: this rank's rows of the global batch's) or drawn from ``gen``;
    ``weight_total``: the normaliser (the whole batch's weight sum), else these rows'.
    """
    b, t = seqs.shape
    device = seqs.device
    s = drafter.block_size
    meta = dense_metadata(b, t, device)
    if states is None:
        hidden, taps = target_states(target, seqs, drafter.target_layer_ids, meta)
    else:
        dtype = drafter.embed_weight.dtype
        hidden, taps = (x.reshape(b * t, -1).to(device, dtype) for x in states)
    context = drafter.combine_hidden_states(taps)
    context_kv = drafter.reference_context_kv(context, meta.positions)
    anchors = (anchors if anchors is not None else draw_anchors(c, b, t, gen)).to(device)
    slot = torch.arange(s, device=device)
    positions = (anchors.unsqueeze(-1) + slot).reshape(-1)  # [B*N*S]
    ids = torch.full((b, c.num_anchors, s), drafter.mask_token_id, device=device)
    ids[:, :, 0] = seqs.gather(1, anchors)
    backend = BlockTrainingBackend(anchors, t, s)
    fctx = ForwardContext(block_metadata(positions, drafter.is_causal), context_kv, backend)
    h = drafter.embed(ids.reshape(-1))
    for layer in drafter.layers:
        h = layer(h, fctx)
    h = drafter.norm(h).view(b, c.num_anchors, s, -1)[:, :, 1:]
    logits = drafter.compute_logits(h.reshape(-1, h.shape[-1]))
    label_pos = (anchors.unsqueeze(-1) + slot[1:]).clamp(max=t - 1)
    labels = seqs.gather(1, label_pos.view(b, -1)).view(-1)
    weights = slot_weights(c, anchors, t, s)
    if c.distill:
        # the target's distribution for the token at a+k is its output at row a+k-1
        rows = (torch.arange(b, device=device).view(b, 1, 1) * t + label_pos - 1).reshape(-1)
        with torch.no_grad():
            teacher = torch.softmax(target.compute_logits(hidden[rows]), dim=-1)
        ce = -(teacher * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
    else:
        ce = F.cross_entropy(logits, labels, reduction="none")
    total = weight_total.to(device) if weight_total is not None else weights.sum()
    return (ce * weights).sum() / total


def save_drafter(drafter: DFlashDraftModel, out: Path, cfg: dict) -> None:
    """Write the drafter checkpoint (bf16 weights, ``cfg`` as config.json) into ``out``, with
    the ``mask_embedding.pt`` (``[H_target]``) it was trained with if it has one (a drafter
    continued from a checkpoint that ships one): without it the engine would fill the masked
    slots with the target's mask row instead. The config names the weights' dtype
    (``torch_dtype: bfloat16``, as the published drafters do); a ``dtype`` carried over from an
    ``init_from`` checkpoint (e.g. ``float32``) would misname it, so it is dropped."""
    cfg = {k: v for k, v in cfg.items() if k != "dtype"} | {"torch_dtype": "bfloat16"}
    save_checkpoint(drafter, out, cfg, dtype=torch.bfloat16)
    mask_file = out / "mask_embedding.pt"
    if drafter.mask_embedding is not None:
        torch.save(drafter.mask_embedding.detach().to("cpu").clone(), mask_file)
    elif mask_file.is_file():
        mask_file.unlink()


def train_draft(c: DraftTrainConfig) -> Path:
    out = Path(c.out_dir)
    work = out / "work"
    check_out_dir(out)
    target_cfg = check_inputs(c, work)
    make_work_dir(out)
    seed_everything(c.seed)
    resolve_device(c.device)  # a clear error where CUDA is asked for but missing
    dp, device = join_data_parallel(torch.device(c.device), c.batch_size)
    if c.num_sequences < dp.world_size:  # the ranks share the regeneration by sequence
        raise ValueError(f"--num-sequences {c.num_sequences} is fewer than the "
                         f"{dp.world_size} launched ranks; use at least one sequence a rank")
    data = regenerate(c, work, dp)
    target = load_model(c.target, torch.float32, device)
    if c.init_from:
        cfg = read_config(c.init_from)
        drafter = load_model(c.init_from, torch.float32, device, target=target)
        shared = {id(p) for p in target.parameters()}
        for p in drafter.parameters():
            p.requires_grad_(id(p) not in shared)
    else:
        cfg = draft_config(c, target_cfg)
        if c.flavour == "laguna":
            drafter = DFlashLaguna(laguna_draft_spec(cfg, {}, target), target)
        else:
            drafter = DFlashDraftModel(qwen3_draft_spec(cfg, target), target)
        randomize_(drafter, c.seed)
    drafter.to(device).train()
    target.prepare_rope(data.shape[1] + drafter.block_size, device)
    drafter.prepare_rope(data.shape[1] + drafter.block_size, device)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=c.lr,
                            betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(c.seed)

    cache = (cached_target_states(target, data, drafter.target_layer_ids, device, dp=dp)
             if c.cache_target_states else None)

    def loss_fn(step: int) -> torch.Tensor:
        # the whole batch's rows and anchors, drawn alike on every rank; this rank's share
        idx = torch.randint(0, data.shape[0], (c.batch_size,), generator=gen)
        anchors = draw_anchors(c, c.batch_size, data.shape[1], gen)
        total = slot_weights(c, anchors, data.shape[1], drafter.block_size).sum()
        share = c.batch_size // dp.world_size
        rows = slice(dp.rank * share, (dp.rank + 1) * share)
        states = None if cache is None else batch_states(cache, idx, rows, dp)
        idx, anchors = idx[rows], anchors[rows]
        with autocast(device):
            return draft_loss(drafter, target, data[idx].to(device), c, gen, states, anchors, total)

    losses, seconds = run_training(
        "train-draft", drafter, opt, loss_fn, steps=c.steps, lr=c.lr, warmup=c.warmup,
        state_path=work / "train_state.pt", save_every=c.save_every, log_every=c.log_every,
        time_budget_s=c.time_budget_s,
        on_save=lambda: save_drafter(drafter, out, cfg), dp=dp,
        generator=gen,
        run_flags={k: v for k, v in asdict(c).items() if k not in RESUMABLE_DRAFT_FIELDS},
    )
    drafter.eval()
    if dp.is_driver:
        save_drafter(drafter, out, cfg)
        summary = {"config": asdict(c), "losses": losses, "seconds": seconds,
                   "num_sequences": int(data.shape[0]), "num_ranks": dp.world_size,
                   "num_cached_sequences": 0 if cache is None else int(cache[0].shape[0])}
        (work / "train_summary.json").write_text(json.dumps(summary, indent=2))
    dp.barrier()  # the checkpoint is written before any rank returns
    return out
