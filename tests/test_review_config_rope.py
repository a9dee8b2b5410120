"""Laguna RoPE config variants against transformers 5.17 (where it reads them) or the reference.

Each case copies the ``xs_mini`` fixture (YaRN on its full layer, default RoPE on the sliding
ones; ``hf_fixtures``) and edits only config.json: RoPE settings create no tensors, so the
same weights describe the changed model. Where transformers reads the variant, its float32
logits of the edited checkpoint are the oracle; where it refuses one that the reference
(reference/laguna.md section 2, XS.2 conflict note) describes, the parsed values are checked
and the model is compared with the equivalent spelling transformers does read.

* YaRN ``mscale`` / ``mscale_all_dim`` without ``attention_factor``: transformers scales cos/sin
  by ``(0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)`` when both are set (we used the
  plain ``0.1 ln s + 1``);
* ``attention_factor`` absent, 1 or another value (transformers uses a given one as is);
* lablup's "XS.2 style": ``original_max_position_embeddings`` at the top level of a nested
  ``rope_parameters`` (transformers crashes on it; it was silently replaced by
  ``max_position_embeddings``);
* ``rope_type: yarn`` without ``factor`` (transformers refuses it; it silently ran as factor 1);
* XS.2's pre-release flat schema and the legacy ``rope_scaling`` key (transformers refuses
  both) resolve to the nested schema's RoPE per layer (already correct; kept as a guard).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import hf_fixtures as hf
import pytest
import torch

from laguna_dflash import LLM
from laguna_dflash.models.laguna import laguna_spec

PROMPT = [(53 * i + 11) % 380 + 3 for i in range(20)]  # longer than xs_mini's window (7)
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def xs_mini(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.make_laguna_checkpoint(tmp_path_factory.mktemp("rope") / "xs_mini", "xs_mini", seed=11)


def _edited(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _full_yarn(cfg: dict) -> dict:
    rope = cfg["rope_parameters"]["full_attention"]
    assert rope["rope_type"] == "yarn"
    return rope


def _assert_logits_match(ours_dir: Path, ref: torch.Tensor) -> None:
    ours = LLM(model=str(ours_dir)).engine.prompt_logits(PROMPT)
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= REL_TOL * scale, f"max|ours - transformers| = {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("yarn", [
    {"mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek-style pair: transformers uses the ratio
    {"mscale": 0.707},                          # one alone: transformers ignores it
    {"attention_factor": 1},                    # the third-party XS.2 copy's value (HF: as is)
    {},                                         # absent: 0.1 ln(factor) + 1
])
def test_yarn_magnitude_matches_transformers(xs_mini: Path, tmp_path: Path, yarn: dict):
    def edit(cfg: dict) -> None:
        rope = _full_yarn(cfg)
        rope.pop("attention_factor")
        rope.update(yarn)

    d = _edited(xs_mini, tmp_path / "ckpt", edit)
    _assert_logits_match(d, hf.hf_prompt_logits(d, PROMPT))


def test_top_level_original_max_position_embeddings_is_the_yarn_base(xs_mini: Path, tmp_path: Path):
    """lablup's "XS.2 style" puts ``original_max_position_embeddings`` beside the per-layer-type
    dicts; it is the YaRN base length of the full layers (factor x original = max positions in
    every release), not ``max_position_embeddings``. The model equals the checkpoint with the
    value inside ``full_attention``, which transformers reads."""
    original = json.loads((xs_mini / "config.json").read_text())
    base = _full_yarn(original)["original_max_position_embeddings"]
    assert base != original["max_position_embeddings"]

    def hoist(cfg: dict) -> None:
        cfg["rope_parameters"]["original_max_position_embeddings"] = _full_yarn(cfg).pop(
            "original_max_position_embeddings")

    d = _edited(xs_mini, tmp_path / "ckpt", hoist)
    spec = laguna_spec(json.loads((d / "config.json").read_text()))
    assert spec.layers[0].rope.original_max_position_embeddings == base
    assert spec.layers[1].rope == laguna_spec(original).layers[1].rope  # sliding: unchanged
    _assert_logits_match(d, hf.hf_prompt_logits(xs_mini, PROMPT))


def test_yarn_without_factor_is_named(xs_mini: Path):
    """transformers refuses YaRN without ``factor``; it ran as factor 1 (no scaling)."""
    cfg = json.loads((xs_mini / "config.json").read_text())
    _full_yarn(cfg).pop("factor")
    with pytest.raises(ValueError, match=r"rope_parameters.*'factor'"):
        laguna_spec(cfg)


def _layer_ropes(cfg: dict) -> list:
    return [layer.rope for layer in laguna_spec(cfg).layers]


@pytest.mark.parametrize("form", ["flat", "rope_scaling"])
def test_pre_release_flat_forms_resolve_as_the_nested_schema(xs_mini: Path, form: str):
    """XS.2's pre-release schema (Ollama ``TestParseConfigLagunaXS``): the YaRN dict WITHOUT its
    own ``partial_rotary_factor`` (the top-level 0.5 applies), ``swa_rope_parameters`` with 1.0
    for the sliding layers, a top-level ``rope_theta``; and the same with the legacy
    ``rope_scaling`` key (``type`` instead of ``rope_type``). transformers refuses both
    (KeyError 'full_attention'); vLLM's resolution gives the nested schema's RoPE per layer."""
    nested = json.loads((xs_mini / "config.json").read_text())
    cfg = copy.deepcopy(nested)
    full = cfg["rope_parameters"].pop("full_attention")
    cfg["partial_rotary_factor"] = full.pop("partial_rotary_factor")
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["swa_rope_parameters"] = cfg["rope_parameters"].pop("sliding_attention")
    if form == "flat":
        cfg["rope_parameters"] = full
    else:
        del cfg["rope_parameters"]
        full["type"] = full.pop("rope_type")
        cfg["rope_scaling"] = full
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["swa_rope_parameters"]["partial_rotary_factor"] == 1.0
    ours = _layer_ropes(cfg)
    assert ours == _layer_ropes(nested)
    assert [r.rotary_dim for r in ours] == [8, 16, 16, 16]  # SWA layers still rotate all dims
