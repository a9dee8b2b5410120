"""Loading edge cases of real configs that the other loader tests leave out.

Every checkpoint is a ``save_pretrained`` fixture (``hf_fixtures``) or a drafter written in the
published on-disk format (``dflash_fixtures``), copied and changed in one config field:

* ``gating_types`` with the wrong number of entries: a ValueError naming the field (it was an
  IndexError, or silently accepted when too long);
* drafter tap ids: ``eagle_aux_hidden_state_layer_ids`` (what vLLM reads first) alone gives the
  taps, and disagreeing with ``dflash_config.target_layer_ids`` is an error naming both;
* ``draft_vocab_size: null`` means the target vocabulary, as an absent field does;
* a missing ``lm_head.weight`` under an untied config says to set ``tie_word_embeddings``;
* Qwen3 ``layer_types`` naming sliding layers without ``use_sliding_window`` or a
  ``sliding_window``: a ValueError naming them (transformers refuses such a config too).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import hf_fixtures as hf
import pytest

from laguna_dflash import LLM
from laguna_dflash.models.loader import CheckpointError, load_model


def _copy_with_config(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint ``src`` to ``dst`` and apply ``edit(config_dict)`` to its config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def laguna(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.make_laguna_checkpoint(tmp_path_factory.mktemp("edges") / "xs_mini", "xs_mini", seed=5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Laguna target (4 layers) with a Poolside and a z-lab drafter tapping [1, 2]."""
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("edge_pair")
    target = df.make_tiny_laguna_target(root / "target", seed=3)
    return {
        "target": target,
        "poolside": df.make_poolside_laguna_drafter(root / "poolside", target, seed=6,
                                                    target_layer_ids=[1, 2]),
        "zlab": df.make_zlab_drafter(root / "zlab", target, seed=6, num_layers=2,
                                     target_layer_ids=[1, 2], distill_steps=0),
    }


# ---- target config ---------------------------------------------------------------------------


@pytest.mark.parametrize("entries", [1, 5])  # xs_mini has 4 layers
def test_gating_types_of_the_wrong_length_is_named(laguna: Path, tmp_path: Path, entries: int):
    """S-2.1 ships ``gating_types`` (one per layer); a list of the wrong length is a ValueError
    naming the field, not an IndexError (too short) or a silently accepted list (too long)."""
    d = _copy_with_config(laguna, tmp_path / "ckpt",
                          lambda c: c.__setitem__("gating_types", ["per_head"] * entries))
    with pytest.raises(ValueError, match="gating_types"):
        load_model(d)


def test_gating_types_of_the_right_length_loads(laguna: Path, tmp_path: Path):
    """The release spelling ``per_head`` per layer loads as per-head gating."""
    d = _copy_with_config(laguna, tmp_path / "ckpt",
                          lambda c: c.__setitem__("gating_types", ["per_head"] * 4))
    model = load_model(d)
    assert [layer.self_attn.gating for layer in model.layers] == ["per-head"] * 4


@pytest.mark.parametrize("tie", ["false", "absent"])
def test_missing_lm_head_under_untied_config_says_tie_word_embeddings(tmp_path: Path, tie: str):
    """A tied checkpoint (no ``lm_head.weight`` on disk) whose config.json says, or defaults to,
    untied: the error names lm_head.weight, the field and the value that fixes it."""
    src = hf.make_qwen3_checkpoint(tmp_path / "tied", seed=2, variant="tied")

    def untie(cfg: dict) -> None:
        if tie == "absent":
            del cfg["tie_word_embeddings"]
        else:
            cfg["tie_word_embeddings"] = False

    d = _copy_with_config(src, tmp_path / "untied", untie)
    with pytest.raises(CheckpointError) as info:
        LLM(model=str(d))
    message = str(info.value)
    assert "lm_head.weight" in message and str(d) in message
    assert '"tie_word_embeddings": true' in message, message


@pytest.mark.parametrize("change", [{"use_sliding_window": False}, {"sliding_window": None}])
def test_qwen3_sliding_layer_types_without_a_window_are_named(tmp_path: Path, change: dict):
    """transformers' Qwen3Config keeps ``sliding_window`` only with ``use_sliding_window: true``
    and then refuses ``layer_types`` naming sliding layers (its mask raises). Such a config is a
    ValueError naming both fields, not a model that windows layers transformers would not, or
    silently runs them unwindowed."""
    src = hf.make_qwen3_checkpoint(tmp_path / "sliding", seed=4, variant="sliding")
    d = _copy_with_config(src, tmp_path / "off", lambda c: c.update(change))
    assert "sliding_attention" in json.loads((d / "config.json").read_text())["layer_types"]
    with pytest.raises(ValueError, match=r"(?s)layer_types.*use_sliding_window.*sliding_window"):
        LLM(model=str(d))
    assert LLM(model=str(src)).engine.target.spec.layers[1].sliding_window == 6  # control


# ---- drafter configs -------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["poolside", "zlab"])
def test_eagle_aux_ids_alone_give_the_taps(pair: dict[str, Path], tmp_path: Path, flavour: str):
    """A drafter config naming its taps only by vLLM's ``eagle_aux_hidden_state_layer_ids``
    (layer output ids, numbered from 1) taps ``id - 1``: not an "empty target_layer_ids" error,
    nor (z-lab) the default taps computed from ``num_target_layers``."""

    def only_eagle(cfg: dict) -> None:
        cfg["dflash_config"].pop("target_layer_ids")
        cfg.pop("target_layer_ids", None)
        cfg["eagle_aux_hidden_state_layer_ids"] = [2, 3]

    d = _copy_with_config(pair[flavour], tmp_path / "eagle", only_eagle)
    drafter = load_model(d, target=load_model(pair["target"]))
    assert drafter.target_layer_ids == (1, 2)


def test_eagle_aux_ids_disagreeing_with_target_layer_ids_is_named(pair: dict[str, Path], tmp_path: Path):
    """vLLM taps ``eagle_aux_hidden_state_layer_ids``, SGLang ``target_layer_ids + 1``: a config
    where they differ would draft from different layers in each, so it is an error naming both
    fields and the consistent eagle ids."""
    d = _copy_with_config(pair["poolside"], tmp_path / "disagree",
                          lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 2]))
    with pytest.raises(ValueError) as info:
        load_model(d, target=load_model(pair["target"]))
    message = str(info.value)
    assert "eagle_aux_hidden_state_layer_ids" in message and "target_layer_ids" in message
    assert "[2, 3]" in message, message


def test_eagle_aux_id_zero_is_named(pair: dict[str, Path], tmp_path: Path):
    """Eagle id 0 is the embedding output, which no DFlash drafter taps: named, not turned into
    layer -1."""

    def embed_tap(cfg: dict) -> None:
        cfg["dflash_config"].pop("target_layer_ids")
        cfg["eagle_aux_hidden_state_layer_ids"] = [0, 3]

    d = _copy_with_config(pair["poolside"], tmp_path / "zero", embed_tap)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids.*embedding"):
        load_model(d, target=load_model(pair["target"]))


def test_null_draft_vocab_size_means_the_target_vocabulary(pair: dict[str, Path], tmp_path: Path):
    """``draft_vocab_size: null`` (and ``vocab_size: null``) is an absent field: the drafter
    shares the target's vocabulary, as when the key is missing."""
    d = _copy_with_config(pair["poolside"], tmp_path / "null_vocab",
                          lambda c: c.update(draft_vocab_size=None, vocab_size=None))
    drafter = load_model(d, target=load_model(pair["target"]))
    assert drafter.lm_head_weight.shape[0] == 64


# ---- generation_config.json's end tokens ------------------------------------------------------


def test_generation_config_eos_ids_stop_generation_too(pair, tmp_path):
    """Instruct checkpoints list their end-of-turn token in generation_config.json only (Qwen3:
    ``<|im_end|>`` there, ``<|endoftext|>`` in config.json); transformers' generate and vLLM stop
    on both. A token the model greedily emits, listed there alone, ends the request as "stop"
    with the DFlash engine and target-only alike; ``ignore_eos`` still runs past it."""
    from laguna_dflash import SamplingParams

    target = pair["target"]
    config_eos = json.loads((target / "config.json").read_text()).get("eos_token_id")
    free = [1, 2, 3, 4, 5]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    first = LLM(str(target)).generate(prompt_token_ids=[free], sampling_params=greedy)[0].token_ids
    listed = [e for e in ([config_eos] if isinstance(config_eos, int) else config_eos or [])]
    cut = next(i for i in range(2, len(first)) if first[i] not in first[:i] and first[i] not in listed)
    copy = shutil.copytree(target, tmp_path / "target")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": listed + [first[cut]]}))
    for draft in (None, pair["poolside"]):
        llm = LLM(str(copy), draft=None if draft is None else str(draft))
        out = llm.generate(prompt_token_ids=[free], sampling_params=greedy)[0]
        assert (out.token_ids, out.finish_reason) == (first[: cut + 1], "stop"), draft
        past = llm.generate(prompt_token_ids=[free], sampling_params=SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert past.token_ids == first and past.finish_reason == "length"


def test_a_malformed_generation_config_eos_is_named(pair, tmp_path):
    copy = shutil.copytree(pair["target"], tmp_path / "target")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ValueError, match=r"generation_config.json field 'eos_token_id'"):
        LLM(str(copy))


def test_a_drafter_trained_for_another_target_depth_is_warned_about(pair, tmp_path, caplog):
    """``num_target_layers`` says which target the drafter was trained on; a drafter made for a
    40-layer target loads on this 4-layer one (its taps exist here), with a warning naming both."""
    def edit(cfg: dict) -> None:
        cfg["dflash_config"]["num_target_layers"] = 40

    other = _copy_with_config(pair["poolside"], tmp_path / "poolside", edit)
    with caplog.at_level("WARNING", logger="laguna_dflash.models.dflash"):
        LLM(str(pair["target"]), draft=str(pair["poolside"]))
        assert "num_target_layers" not in caplog.text
        LLM(str(pair["target"]), draft=str(other))
    assert "trained against a 40-layer target" in caplog.text and "4-layer one" in caplog.text


@pytest.mark.parametrize("flavour", ["poolside", "zlab"])
@pytest.mark.parametrize("field, value, needle", [
    ("block_size", "16", "dflash_config.block_size must be an integer >= 2"),
    ("block_size", 1, "dflash_config.block_size must be an integer >= 2"),
    ("mask_token_id", 3.5, "dflash_config.mask_token_id must be an integer >= 0"),
    ("target_layer_ids", [1, "2"], "dflash_config.target_layer_ids must be a list"),
])
def test_badly_typed_drafter_fields_are_named(pair, tmp_path, flavour, field, value, needle):
    """These fields went through bare int(): "16" loaded as 16, 3.5 as 3, and ["2"] failed with
    a Python TypeError naming no field."""
    def edit(cfg: dict) -> None:
        cfg["dflash_config"][field] = value

    bad = _copy_with_config(pair[flavour], tmp_path / flavour, edit)
    with pytest.raises(ValueError, match=re.escape(needle)):
        LLM(str(pair["target"]), draft=str(bad))


def test_a_badly_typed_drafter_rms_norm_eps_is_named(pair, tmp_path):
    bad = _copy_with_config(pair["poolside"], tmp_path / "p", lambda cfg: cfg.update(rms_norm_eps="1e-6"))
    with pytest.raises(ValueError, match="'rms_norm_eps' must be a number"):
        LLM(str(pair["target"]), draft=str(bad))


def test_weights_of_another_architecture_point_at_architectures(laguna, tmp_path):
    """A Laguna checkpoint whose config.json says Qwen3ForCausalLM lacks the dense MLPs Qwen3
    needs and holds experts in their place; the error says to check ``architectures`` rather
    than to re-export the checkpoint."""
    bad = _copy_with_config(laguna, tmp_path / "x", lambda cfg: cfg.update(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=True))
    with pytest.raises(CheckpointError, match=r"check config.json's architectures \(it says Qwen3ForCausalLM\)"):
        load_model(str(bad), device="cpu")
