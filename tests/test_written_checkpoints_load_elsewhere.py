"""Checkpoints that ``laguna-dflash`` WRITES load in the ecosystem's own code.

The other tests write checkpoints with transformers / the ``dflash`` package and load them here;
these go the other way:

* a ``train-target`` checkpoint (bf16, sharded, ``generation_config.json``, tokenizer) and a
  ``save_checkpoint`` of an in-memory model load in transformers' ``LagunaForCausalLM`` with no
  missing / unexpected / mismatched weights, and give our logits (float32, atol 1e-4);
* a Qwen3-flavour drafter written by ``save_drafter`` loads in the PyPI ``dflash`` reference
  ``DFlashDraftModel.from_pretrained`` with every weight, and the reference's block forward gives
  our engine's draft logits and tokens for the same context taps and block;
* a Laguna-flavour drafter written by ``save_drafter`` (no reference class is installed) has the
  config fields and tensor names / shapes / dtype of the published Poolside layout
  (reference/laguna.md 4.1-4.4), and our loader reads it back to identical weights.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from laguna_dflash import LLM
from laguna_dflash.engine.attention import TorchSDPABackend
from laguna_dflash.engine.kv_cache import KVCache
from laguna_dflash.engine.runner import ForwardItem, ModelRunner
from laguna_dflash.models.dflash import DFlashDraftModel, qwen3_draft_spec
from laguna_dflash.models.laguna import LagunaForCausalLM
from laguna_dflash.models.laguna_dflash import DFlashLaguna, laguna_draft_spec
from laguna_dflash.models.layers import ForwardContext
from laguna_dflash.models.loader import load_model, read_config
from laguna_dflash.models.random_init import randomize_
from laguna_dflash.models.writer import save_checkpoint
from laguna_dflash.train import data
from laguna_dflash.train.backend import DenseTrainingBackend, dense_metadata
from laguna_dflash.train.draft import DraftTrainConfig, draft_config, save_drafter, target_states
from laguna_dflash.train.target import TargetTrainConfig, demo_target_config, train_target

ATOL = 1e-4
# A tiny demo target: 4 layers (full, sliding, sliding, full), window 8, 4 experts + shared.
TINY_TARGET = dict(vocab_size=300, hidden_size=64, num_layers=4, num_experts=4,
                   moe_intermediate_size=32, sliding_window=8)
_rng = random.Random(7)
# 3 prompts; two are longer than the sliding window (8), all ids inside the 300-token vocabulary
PROMPTS = [[_rng.randrange(5, 300) for _ in range(n)] for n in (5, 17, 29)]


@contextmanager
def transformers_log() -> Iterator[list[str]]:
    """Collect the messages of transformers' loggers (its root logger does not propagate)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, root = Collect(level=logging.WARNING), logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)


def assert_loaded_cleanly(info: dict, messages: list[str]) -> None:
    """``output_loading_info`` is empty and nothing was logged about missing / new weights."""
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[key], f"{key}: {sorted(info[key])}"
    bad = [m for m in messages if any(w in m.lower() for w in (
        "missing", "unexpected", "newly initialized", "not initialized", "not used"))]
    assert not bad, bad


def hf_laguna(directory: Path):
    """transformers' ``LagunaForCausalLM`` from ``directory``, float32, with its loading info."""
    from transformers import LagunaForCausalLM as HFLaguna

    with transformers_log() as messages:
        model, info = HFLaguna.from_pretrained(
            str(directory), dtype=torch.float32, attn_implementation="eager",
            experts_implementation="eager", output_loading_info=True)
    assert_loaded_cleanly(info, messages)
    return model.eval()


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float()


@torch.no_grad()
def dense_logits(model, prompt: list[int]) -> torch.Tensor:
    """Our in-memory model's logits ``[T, V]`` for one prompt (the training forward)."""
    meta = dense_metadata(1, len(prompt), torch.device("cpu"))
    ctx = ForwardContext(meta, [(None, None)] * len(model.layers), DenseTrainingBackend())
    hidden, _ = model(torch.tensor(prompt), ctx)
    return model.compute_logits(hidden)


def round_to_bf16_(model: torch.nn.Module) -> None:
    """Round the weights the writer stores in bf16 to bf16 values, so a bf16 checkpoint holds
    exactly the in-memory model (the writer keeps ``e_score_correction_bias`` in float32)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("e_score_correction_bias"):
                p.copy_(p.to(torch.bfloat16).float())


def safetensors_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.fixture(scope="module")
def trained_target(tmp_path_factory) -> Path:
    """``train-target`` end to end (2 steps on a slice of the corpus), sharded bf16 output."""
    torch.manual_seed(0)
    return train_target(TargetTrainConfig(
        out_dir=str(tmp_path_factory.mktemp("written") / "target"), seq_len=32, batch_size=2,
        steps=2, warmup=1, max_corpus_bytes=30_000, log_every=1, max_shard_bytes=1 << 16,
        **TINY_TARGET))


# --------------------------------------------------------------------------------------------
# 1. Laguna targets -> transformers
# --------------------------------------------------------------------------------------------


def test_train_target_checkpoint_loads_in_transformers(trained_target):
    """transformers loads a ``train-target`` checkpoint (sharded bf16 + index) with no missing,
    unexpected or mismatched weights (nor a log line about them); its float32 logits equal our
    engine's on the same files (atol 1e-4) on prompts shorter and longer than the sliding
    window; its ``generation_config.json`` and tokenizer load with the special ids of
    ``config.json``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    assert len(list(trained_target.glob("model-*.safetensors"))) > 1  # the sharded path
    with transformers_log() as messages:
        ref, info = AutoModelForCausalLM.from_pretrained(
            str(trained_target), dtype=torch.float32, attn_implementation="eager",
            experts_implementation="eager", output_loading_info=True)
    assert_loaded_cleanly(info, messages)
    assert type(ref).__name__ == "LagunaForCausalLM"
    llm = LLM(str(trained_target), dtype="float32")
    for prompt in PROMPTS:
        torch.testing.assert_close(llm.engine.prompt_logits(prompt), hf_logits(ref, prompt),
                                   rtol=0, atol=ATOL)
    cfg = read_config(trained_target)
    gen = GenerationConfig.from_pretrained(str(trained_target))  # raises if the file is missing
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        data.BOS_ID, data.EOS_ID, data.PAD_ID)
    tok = AutoTokenizer.from_pretrained(str(trained_target))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (
        cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["mask_token_id"])
    assert len(tok) <= cfg["vocab_size"]
    assert tok.decode(tok("def f(x):\n    return x").input_ids) == "def f(x):\n    return x"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_saved_model_is_the_in_memory_model_in_transformers(tmp_path, tied):
    """``save_checkpoint`` as ``train-target`` calls it (bf16, shards) writes exactly the model in
    memory: transformers' float32 logits of the written files equal the in-memory model's own
    (atol 1e-4), with an untied ``lm_head`` and with ``tie_word_embeddings`` (no ``lm_head``
    tensor on disk, transformers ties it to the embedding)."""
    cfg = {**demo_target_config(TargetTrainConfig(out_dir="unused", **TINY_TARGET)),
           "tie_word_embeddings": tied}
    model = LagunaForCausalLM.from_config(cfg)
    randomize_(model, 3)
    with torch.no_grad():  # a non-zero score bias: selection differs from the plain top-k
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    round_to_bf16_(model)
    model.eval().prepare_rope(64, "cpu")
    save_checkpoint(model, tmp_path, cfg, dtype=torch.bfloat16, max_shard_bytes=1 << 16)
    assert ("lm_head.weight" in safetensors_tensors(tmp_path)) is not tied
    ref = hf_laguna(tmp_path)
    assert ref.config.tie_word_embeddings is tied
    for prompt in PROMPTS:
        torch.testing.assert_close(dense_logits(model, prompt), hf_logits(ref, prompt),
                                   rtol=0, atol=ATOL)


# --------------------------------------------------------------------------------------------
# 2. Qwen3-flavour drafter -> the PyPI dflash reference
# --------------------------------------------------------------------------------------------


BLOCK = 4


@torch.no_grad()
def our_block_logits(drafter, taps: torch.Tensor, ids: list[int], anchor: int) -> torch.Tensor:
    """Our engine's draft logits ``[B-1, V]``: context K/V of positions ``< anchor`` from
    ``taps``, then the block ``ids`` at positions ``anchor ..`` through the paged-KV runner."""
    kv = KVCache(len(drafter.layers), 8, 16, drafter.num_kv_heads, drafter.head_dim, torch.float32, "cpu")
    runner = ModelRunner(drafter, kv, TorchSDPABackend(), torch.device("cpu"))
    pos = torch.arange(anchor)
    drafter.precompute_and_store_context_kv(drafter.combine_hidden_states(taps[:anchor]), pos, pos, kv.layers)
    h, _ = runner.forward(ids, [ForwardItem(len(ids), anchor, anchor + len(ids), list(range(8)))],
                          is_causal=drafter.is_causal)
    return drafter.compute_logits(h[1:])


@torch.no_grad()
def reference_block_logits(ref, target, taps: torch.Tensor, ids: list[int], anchor: int) -> torch.Tensor:
    """The ``dflash`` reference's draft logits ``[B-1, V]`` for the same inputs: its forward
    over raw taps of positions ``< anchor`` and the target-embedded block, positions
    ``0 .. anchor+B-1``, then the target's ``lm_head``."""
    out = ref(position_ids=torch.arange(anchor + len(ids))[None],
              noise_embedding=F.embedding(torch.tensor([ids]), target.embed_tokens.weight),
              target_hidden=taps[None, :anchor])
    return F.linear(out[0, 1:], target.lm_head_weight).float()


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target written by transformers' ``save_pretrained``."""
    import dflash_fixtures as df

    return df.make_tiny_qwen3_target(tmp_path_factory.mktemp("qwen3") / "target", seed=3)


def test_qwen3_drafter_loads_in_dflash_reference(qwen3_target, tmp_path):
    """A Qwen3-flavour drafter as ``train-draft`` writes it (``draft_config`` + ``save_drafter``,
    on a transformers-written Qwen3 target) loads in ``dflash.model.DFlashDraftModel`` with no
    missing / unexpected weights, reads the same block size, mask id and taps, holds exactly
    our weights, and its block forward gives our engine's draft logits (atol 1e-4) and argmax
    tokens for the same context taps and block, at several anchors."""
    from dflash.model import DFlashDraftModel as Reference

    tdir = qwen3_target
    target = load_model(tdir)
    c = DraftTrainConfig(target=str(tdir), out_dir=str(tmp_path / "draft"), flavour="qwen3",
                         num_layers=2, block_size=BLOCK, mask_token_id=63)
    cfg = draft_config(c, read_config(tdir))
    drafter = DFlashDraftModel(qwen3_draft_spec(cfg, target), target)
    randomize_(drafter, 1)
    round_to_bf16_(drafter)
    save_drafter(drafter, Path(c.out_dir), cfg)

    with transformers_log() as messages:
        ref, info = Reference.from_pretrained(c.out_dir, dtype=torch.float32, output_loading_info=True)
    assert_loaded_cleanly(info, messages)
    ref.eval()
    assert (ref.block_size, ref.mask_token_id, list(ref.target_layer_ids)) == (
        drafter.block_size, drafter.mask_token_id, list(drafter.target_layer_ids))
    on_disk = safetensors_tensors(Path(c.out_dir))
    ref_sd = ref.state_dict()
    assert ref_sd.keys() == on_disk.keys()  # split q/k/v, separate gate/up, no embedding / head
    for name, w in on_disk.items():
        assert torch.equal(ref_sd[name], w.float()), name

    ours = load_model(c.out_dir, target=target)  # the engine's drafter, from the same files
    mine, back = drafter.state_dict(), ours.state_dict()
    assert mine.keys() == back.keys()
    assert all(torch.equal(mine[k], back[k]) for k in mine)
    seq = torch.randint(0, 63, (24,), generator=torch.Generator().manual_seed(4))
    target.prepare_rope(64, "cpu")
    ours.prepare_rope(64, "cpu")
    # the same raw taps go to both (pre-final-norm, as our engine and vLLM tap; the reference's
    # own loop would read a tap on the last layer after the final norm, from transformers)
    _, taps = target_states(target, seq[None], ours.target_layer_ids)
    for anchor in (3, 11, 20):
        ids = [int(seq[anchor])] + [ours.mask_token_id] * (BLOCK - 1)
        got = our_block_logits(ours, taps, ids, anchor)
        want = reference_block_logits(ref, target, taps, ids, anchor)
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_continued_drafter_config_names_its_bf16_weights(qwen3_target, tmp_path):
    """``train-draft --init-from`` a float32 z-lab drafter (its config says ``dtype: float32``):
    ``save_drafter`` writes bf16 weights and a config that says so (``torch_dtype: bfloat16``,
    no stale ``dtype``), so the reference's default load (transformers' ``dtype="auto"``) gives
    bf16, as for a fresh drafter and the published ones, not an upcast float32 copy."""
    import dflash_fixtures as df
    from dflash.model import DFlashDraftModel as Reference

    source = df.make_zlab_drafter(tmp_path / "zlab", qwen3_target, distill_steps=0)
    assert read_config(source)["dtype"] == "float32"
    target = load_model(qwen3_target)
    drafter = load_model(source, target=target)
    save_drafter(drafter, tmp_path / "continued", read_config(source))  # as train_draft does
    written = read_config(tmp_path / "continued")
    assert written["torch_dtype"] == "bfloat16" and "dtype" not in written
    assert {t.dtype for t in safetensors_tensors(tmp_path / "continued").values()} == {torch.bfloat16}
    ref = Reference.from_pretrained(str(tmp_path / "continued"))
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}


# --------------------------------------------------------------------------------------------
# 3. Laguna-flavour drafter: the published Poolside layout, and our loader's round trip
# --------------------------------------------------------------------------------------------


def test_laguna_drafter_matches_poolside_layout_and_round_trips(trained_target, tmp_path):
    """A Laguna-flavour drafter as ``train-draft`` writes it has the config of the published
    ``DFlashLagunaForCausalLM`` checkpoints (laguna.md 4.1: architecture, model_type, top-level
    rope_theta and no rope_parameters, uniform sliding layers, per-head gating, no experts,
    draft vocabulary = target vocabulary, ``eagle_aux_hidden_state_layer_ids = taps + 1``,
    ``dflash_config`` with ``causal: true``, bf16 ``torch_dtype``) and exactly the tensor names,
    shapes and dtype of 4.2 (no ``model.`` prefix, fused Q|K|V ``qkv_proj``, per-tap
    ``aux_hidden_norms``, no embedding / ``lm_head``); our loader reads it back to the same
    weights and ``mask_embedding.pt``."""
    target = load_model(trained_target)
    tcfg = read_config(trained_target)
    c = DraftTrainConfig(target=str(trained_target), out_dir=str(tmp_path), flavour="laguna",
                         num_layers=2, block_size=BLOCK)
    cfg = draft_config(c, tcfg)
    drafter = DFlashLaguna(laguna_draft_spec(cfg, {}, target), target)
    randomize_(drafter, 2)
    round_to_bf16_(drafter)
    drafter.mask_embedding = torch.randn(tcfg["hidden_size"])
    save_drafter(drafter, tmp_path, cfg)

    written = json.loads((tmp_path / "config.json").read_text())
    n_layers, hidden, taps = written["num_hidden_layers"], written["hidden_size"], drafter.target_layer_ids
    nh, nkv, hd = written["num_attention_heads"], written["num_key_value_heads"], written["head_dim"]
    inter, h_t = written["intermediate_size"], tcfg["hidden_size"]
    assert written["architectures"] == ["DFlashLagunaForCausalLM"]
    assert written["model_type"] == "laguna"
    assert "rope_parameters" not in written and isinstance(written["rope_theta"], float)
    assert written["layer_types"] == ["sliding_attention"] * n_layers
    assert written["gating"] == "per-head" and written["num_experts"] == 0
    assert written["vocab_size"] == written["draft_vocab_size"] == tcfg["vocab_size"]
    assert hidden == h_t  # the block is embedded with the target's embedding
    assert (written["hidden_act"], written["attention_bias"], written["rms_norm_eps"]) == ("silu", False, 1e-6)
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "sliding_window"):
        assert isinstance(written[key], int) and written[key] > 0, key
    assert written["torch_dtype"] == "bfloat16"
    dcfg = written["dflash_config"]
    assert dcfg == {"block_size": BLOCK, "mask_token_id": tcfg["mask_token_id"],
                    "num_target_layers": tcfg["num_hidden_layers"],
                    "target_layer_ids": list(taps), "causal": True}
    assert written["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in dcfg["target_layer_ids"]]
    assert all(0 <= t < tcfg["num_hidden_layers"] for t in dcfg["target_layer_ids"])

    tensors = safetensors_tensors(tmp_path)
    expected = {"fc.weight": (hidden, len(taps) * h_t), "hidden_norm.weight": (hidden,),
                "norm.weight": (hidden,)}
    expected.update({f"aux_hidden_norms.{j}.weight": (h_t,) for j in range(len(taps))})
    for i in range(n_layers):
        p = f"layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, nh * hd), p + "self_attn.g_proj.weight": (nh, hidden),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert len(tensors) == 10 * n_layers + 3 + len(taps)
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}

    loaded = load_model(tmp_path, target=target)
    assert type(loaded) is DFlashLaguna
    ours, back = drafter.state_dict(), loaded.state_dict()
    assert ours.keys() == back.keys()
    for name in ours:
        assert torch.equal(ours[name], back[name]), name
    assert torch.equal(loaded.mask_embedding, drafter.mask_embedding)
    assert (loaded.block_size, loaded.mask_token_id, loaded.target_layer_ids, loaded.is_causal) == (
        BLOCK, tcfg["mask_token_id"], taps, True)
