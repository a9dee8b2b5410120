"""``laguna-dflash train-target``: pretrain a small Laguna-architecture MoE on Python source.

The model has the real Laguna features at small sizes (sliding and full layers with per-layer
head counts, partial YaRN RoPE on full layers, softplus per-head gating, QK-norm, a dense first
layer, sigmoid-routed experts with a correction bias and a shared expert). It is written in the
Hugging Face layout the loader reads, with its byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import resolve_device
from ..models.laguna import LagunaForCausalLM
from ..models.layers import ForwardContext
from ..models.random_init import randomize_, small_rope_parameters
from ..models.writer import save_checkpoint
from . import data
from .backend import DenseTrainingBackend, dense_metadata
from .common import (
    arg,
    autocast,
    balance_moe_,
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
class TargetTrainConfig:
    out_dir: str = arg("folder for the checkpoint and tokenizer; its work/ subfolder keeps the token "
                       "cache and the resumable training state")
    vocab_size: int = arg("tokens of the byte-level BPE tokenizer trained on the corpus", 4096)
    hidden_size: int = arg("model width", 256)
    num_layers: int = arg("decoder layers: full attention every third, sliding window otherwise; "
                          "the first MLP dense, the rest MoE", 6)
    num_experts: int = arg("routed experts an MoE layer", 8)
    top_k: int = arg("routed experts a token", 2)
    moe_intermediate_size: int = arg("width of each expert's and the shared expert's MLP", 256)
    sliding_window: int = arg("tokens the sliding-window layers attend to", 128)
    seq_len: int = arg("tokens a training sequence", 512)
    batch_size: int = shared_arg("batch_size", 32)
    steps: int = shared_arg("steps", 2000)
    lr: float = shared_arg("lr", 3e-3)
    warmup: int = shared_arg("warmup", 100)
    weight_decay: float = arg("AdamW weight decay", 0.1)
    seed: int = arg("seed of the weights and batches", 0)
    device: str = shared_arg("device", "cpu")
    max_corpus_bytes: int | None = arg("read at most this many characters of source (default: the "
                                       "whole standard library training split)", None)
    save_every: int = shared_arg("save_every", 500)
    log_every: int = shared_arg("log_every", 50)
    time_budget_s: float | None = shared_arg("time_budget_s", None)
    max_shard_bytes: int | None = arg("split model.safetensors into shards of at most this many bytes",
                                      15 << 20)

    def __post_init__(self) -> None:
        require_at_least(self, vocab_size=256 + len(data.SPECIAL_TOKENS), hidden_size=1, num_layers=1,
                         num_experts=1, top_k=1, moe_intermediate_size=1, sliding_window=1, seq_len=1,
                         batch_size=1, steps=1, warmup=0, weight_decay=0, max_corpus_bytes=0,
                         save_every=1, log_every=1, max_shard_bytes=1)
        require_positive(self, "lr", "time_budget_s")
        check_device(self.device)
        if self.top_k > self.num_experts:
            raise ValueError(f"--top-k {self.top_k} exceeds --num-experts {self.num_experts}")
        if self.seq_len > MAX_POSITIONS:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the model's max_position_embeddings "
                             f"{MAX_POSITIONS}; lower it")
        head_dim = _head_dim(self.hidden_size)
        heads = self.hidden_size // head_dim
        if heads < 2 or heads % 2:
            raise ValueError(f"--hidden-size {self.hidden_size} gives {heads} attention head(s) of "
                             f"{head_dim}; it needs an even number (e.g. a multiple of 128)")
        if head_dim % 4:  # RoPE rotates pairs of dims: all of a sliding head, half of a full one
            raise ValueError(f"--hidden-size {self.hidden_size} gives attention heads of {head_dim} "
                             "dims; RoPE needs a multiple of 4 (the full-attention layers rotate "
                             "half of each head in pairs): pick a multiple of 16 below 256 or of "
                             "128 from 256")


MAX_POSITIONS = 4096  # the demo target's max_position_embeddings

#: Fields a resumed ``train-target`` may change (the rest must equal the interrupted run's):
#: where it runs and reports, how long, and how the corpus (cached in ``work/``) and the
#: checkpoint files are made.
RESUMABLE_TARGET_FIELDS = frozenset({
    "out_dir", "steps", "device", "save_every", "log_every", "time_budget_s", "max_corpus_bytes",
    "max_shard_bytes"})


def _head_dim(hidden_size: int) -> int:
    return min(64, max(16, hidden_size // 4))


def demo_target_config(c: TargetTrainConfig) -> dict:
    """config.json of the demo target: full attention every 3rd layer, sliding otherwise."""
    types = ["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(c.num_layers)]
    head_dim = _head_dim(c.hidden_size)
    return {
        "architectures": ["LagunaForCausalLM"], "model_type": "laguna",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": 4 * c.hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.hidden_size // head_dim,
        "num_key_value_heads": 2, "head_dim": head_dim,
        "num_attention_heads_per_layer": [c.hidden_size // head_dim * (1 if t == "full_attention" else 2)
                                          for t in types],
        "layer_types": types, "sliding_window": c.sliding_window, "gating": "per-head",
        "mlp_layer_types": ["dense"] + ["sparse"] * (c.num_layers - 1),
        "num_experts": c.num_experts, "num_experts_per_tok": c.top_k,
        "moe_intermediate_size": c.moe_intermediate_size,
        "shared_expert_intermediate_size": c.moe_intermediate_size,
        "moe_routed_scaling_factor": 2.5, "moe_router_logit_softcapping": 0.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": False,
        "rope_parameters": small_rope_parameters(),
        "bos_token_id": data.BOS_ID, "eos_token_id": data.EOS_ID, "pad_token_id": data.PAD_ID,
        "mask_token_id": data.MASK_ID, "torch_dtype": "bfloat16",
    }


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``tokens [B, T+1]`` through the inference modules."""
    b, t1 = tokens.shape
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    meta = dense_metadata(b, t1 - 1, tokens.device)
    ctx = ForwardContext(meta, [(None, None)] * len(model.layers), DenseTrainingBackend())
    hidden, _ = model(inputs.reshape(-1), ctx)
    logits = model.compute_logits(hidden)
    return F.cross_entropy(logits, labels.reshape(-1))


def build_corpus(c: TargetTrainConfig, out: Path) -> np.ndarray:
    """Train the tokenizer (once) and encode the training split; cached under ``out/work``."""
    work = make_work_dir(out)
    cache = work / "train_tokens.npy"
    texts = data.read_texts(data.stdlib_files("train"), c.max_corpus_bytes)
    if not (out / "tokenizer.json").is_file():
        data.train_tokenizer(texts, c.vocab_size, out)
    num_ids = data.load_tokenizer(out).get_vocab_size()
    if num_ids > c.vocab_size:
        raise ValueError(f"{out / 'tokenizer.json'} (from an earlier run) has {num_ids} tokens, more "
                         f"than --vocab-size {c.vocab_size}; use that run's --vocab-size or a new --out-dir")
    if cache.is_file():
        tokens = np.load(cache)
    else:
        tokens = data.encode_corpus(texts, data.load_tokenizer(out))
        np.save(cache, tokens)
        logger.info("corpus: %d files, %d tokens", len(texts), len(tokens))
    if len(tokens) < c.seq_len + 2:
        raise ValueError(f"the corpus has {len(tokens)} tokens, too few for --seq-len {c.seq_len}; "
                         "raise --max-corpus-bytes or lower --seq-len")
    return tokens


def train_target(c: TargetTrainConfig) -> Path:
    """Pretrain the target. Under a torchrun-style launch the ranks are data-parallel replicas
    (as ``train-draft``'s): each computes its rows of every batch (the same global rows on every
    rank), gradients and expert loads are summed over the ranks, and rank 0 alone writes."""
    out = Path(c.out_dir)
    check_out_dir(out)
    seed_everything(c.seed)
    dp, device = join_data_parallel(resolve_device(c.device), c.batch_size)
    if not dp.is_driver:  # rank 0 trains the tokenizer and writes the corpus cache; then read
        dp.barrier()
    tokens = torch.from_numpy(build_corpus(c, out).astype(np.int64))
    if dp.is_driver:
        dp.barrier()
    cfg = demo_target_config(c)
    model = LagunaForCausalLM.from_config(cfg)
    randomize_(model, c.seed)
    model.to(device).train()
    model.prepare_rope(c.seq_len + 1, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=c.lr,
                            betas=(0.9, 0.95), weight_decay=c.weight_decay)
    gen = torch.Generator().manual_seed(c.seed)

    share = c.batch_size // dp.world_size

    def loss_fn(step: int) -> torch.Tensor:
        starts = torch.randint(0, len(tokens) - c.seq_len - 1, (c.batch_size,), generator=gen)
        starts = starts[dp.rank * share : (dp.rank + 1) * share]  # this rank's rows
        batch = torch.stack([tokens[s : s + c.seq_len + 1] for s in starts.tolist()]).to(device)
        with autocast(device):
            # every row has seq_len tokens: the batch's mean is the ranks' means, each weighted
            # share / batch_size, so the parts sum to the whole batch's loss (x 1 on one rank)
            return lm_loss(model, batch) * (share / c.batch_size)

    losses, seconds = run_training(
        "train-target", model, opt, loss_fn, steps=c.steps, lr=c.lr, warmup=c.warmup,
        state_path=out / "work" / "train_state.pt", save_every=c.save_every,
        log_every=c.log_every, time_budget_s=c.time_budget_s,
        after_step=lambda: balance_moe_(model, 1e-3, dp), generator=gen, dp=dp,
        run_flags={k: v for k, v in asdict(c).items() if k not in RESUMABLE_TARGET_FIELDS},
    )
    model.eval()
    if dp.is_driver:
        save_checkpoint(model, out, cfg, dtype=torch.bfloat16, max_shard_bytes=c.max_shard_bytes)
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": data.BOS_ID, "eos_token_id": data.EOS_ID, "pad_token_id": data.PAD_ID}) + "\n")
        summary = {"config": asdict(c), "final_loss": float(np.mean(losses[-50:])) if losses else None,
                   "first_loss": losses[0] if losses else None, "seconds": seconds,
                   "num_corpus_tokens": len(tokens), "num_ranks": dp.world_size, "losses": losses}
        (out / "work" / "train_summary.json").write_text(json.dumps(summary, indent=2))
        logger.info("train-target done: %s", summary)
    dp.barrier()  # the checkpoint is written before any rank returns
    return out
