"""Checkpoint loading: a local HF directory (``config.json`` + safetensors, single or sharded).

The model is built on the meta device, cast to the requested dtype while still on meta, given
real (uninitialised) storage on the target device, and then every tensor is streamed from the
safetensors files straight into its parameter (or row slice of a fused parameter), so two full
copies never exist. Key checks are strict: missing, unexpected and mis-shaped tensors are errors
that name the tensor and both shapes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..distributed import Split
from .registry import resolve_architecture, supported_architectures

logger = logging.getLogger(__name__)

# Tensors some exporters write that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked; the message says why and how to fix."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What is on disk: the config dict, tensor name -> file, tensor name -> shape, tensor name
    -> safetensors dtype (``"BF16"``, ``"F32"``, ``"I8"``, ...)."""

    path: Path
    config: dict
    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]


def read_config(path: str | Path) -> dict:
    """Parse ``config.json`` of a checkpoint directory with clear errors."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory; pass a local HF checkpoint directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} not found; a checkpoint directory needs a config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); fix or re-export the config") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list) or not isinstance(archs[0], str):
        raise CheckpointError(
            f"{cfg_file} lacks an 'architectures' list; add e.g. \"architectures\": "
            f"[\"LagunaForCausalLM\"] (supported: {', '.join(supported_architectures())})"
        )
    return cfg


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Read the config and the tensor index (names, files, shapes) without loading tensors."""
    path = Path(path)
    cfg = read_config(path)
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    files: dict[str, Path] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed ({e!r}); it needs a 'weight_map' object") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} is malformed: 'weight_map' must map tensor names to shard "
                                  "file names; re-export the checkpoint")
        for name, fname in weight_map.items():
            if not (path / fname).is_file():
                raise CheckpointError(f"{index} maps {name!r} to missing shard {fname!r}")
            files[name] = path / fname
    elif single.is_file():
        with _open_safetensors(single) as f:
            files = dict.fromkeys(f.keys(), single)
    else:
        raise CheckpointError(
            f"no weights in {path}: expected model.safetensors or model.safetensors.index.json"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for fname in sorted(set(files.values())):
        with _open_safetensors(fname) as f:
            for name in f.keys():
                if files.get(name) == fname:
                    tensor = f.get_slice(name)
                    shapes[name], dtypes[name] = tuple(tensor.get_shape()), str(tensor.get_dtype())
    return CheckpointInfo(path=path, config=cfg, files=files, shapes=shapes, dtypes=dtypes)


def _open_safetensors(fname: Path):
    """``safe_open`` whose failure (a truncated download, not a safetensors file) names the file."""
    try:
        return safe_open(fname, framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{fname} is not a readable safetensors file ({e}); re-download or "
                              "re-export the checkpoint") from e


def describe_checkpoint(path: str | Path, load_format: str = "auto") -> CheckpointInfo:
    """What :func:`load_model` will read: the full tensor index, or only config.json for dummy."""
    if load_format == "dummy":
        return CheckpointInfo(Path(path), read_config(path), {}, {})
    return inspect_checkpoint(path)


@dataclass(frozen=True)
class _Destination:
    """Where one on-disk tensor goes: a parameter (view) and, if sharded, this rank's part."""

    tensor: torch.Tensor
    split: Split | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The on-disk shape this destination expects."""
        local = tuple(self.tensor.shape)
        return local if self.split is None else self.split.disk_shape(local)


def _select_destinations(groups: list, available: set[str]) -> dict[str, _Destination]:
    """Pick one spelling per group (the first whose first name is on disk) -> name: destination."""
    chosen: dict[str, _Destination] = {}
    for options in groups:
        option = next((opt for opt in options if opt[0][0] in available), options[0])
        for name, dest, *split in option:
            chosen[name] = _Destination(dest, split[0] if split else None)
    return chosen


#: safetensors dtypes a weight may be stored in (cast to the model's dtype on load).
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


def _fail_on_mismatch(info: CheckpointInfo, dests: dict[str, _Destination], ignorable: set[str]) -> None:
    available = set(info.shapes)
    missing = sorted(set(dests) - available)
    unexpected = sorted(
        n for n in available - set(dests) - ignorable if not n.endswith(_IGNORED_SUFFIXES)
    )
    if missing:
        listed = ", ".join(f"{n} (expected shape {tuple(dests[n].shape)})" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        fix = "re-export the checkpoint or fix config.json"
        if unexpected:  # tensors of another layout in their place: likely another model's
            fix = (f"it also holds {len(unexpected)} tensor(s) {info.architecture} does not use "
                   f"(e.g. {unexpected[0]}): check config.json's architectures (it says "
                   f"{info.architecture}), or re-export the checkpoint")
        elif missing == ["lm_head.weight"] and not info.config.get("tie_word_embeddings"):
            fix = ("config.json has tie_word_embeddings "
                   f"{'absent' if 'tie_word_embeddings' not in info.config else 'false'}; if the "
                   "output projection is the input embedding, set \"tie_word_embeddings\": true, "
                   "else re-export the checkpoint with lm_head.weight")
        raise CheckpointError(
            f"checkpoint {info.path} is missing {len(missing)} tensor(s) that "
            f"{info.architecture} needs: {listed}{more}; {fix}"
        )
    if unexpected:
        listed = ", ".join(f"{n} (shape {info.shapes[n]})" for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"checkpoint {info.path} has {len(unexpected)} unexpected tensor(s) for "
            f"{info.architecture}: {listed}{more}; config.json probably does not match the weights"
        )
    packed = sorted(n for n in dests if info.dtypes.get(n, "F32") not in _FLOAT_DTYPES)
    if packed:
        listed = ", ".join(f"{n} ({info.dtypes[n]})" for n in packed[:5])
        raise CheckpointError(
            f"checkpoint {info.path} stores {len(packed)} weight(s) as non-float data: {listed}; "
            "quantized checkpoints are not supported, use a bf16, fp16 or fp32 export")
    for name, dest in dests.items():
        if tuple(dest.shape) != info.shapes[name]:
            raise CheckpointError(
                f"tensor {name} in {info.files[name].name} has shape {info.shapes[name]} but "
                f"{info.architecture} expects {tuple(dest.shape)} from config.json; the config does "
                "not match the weights"
            )


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Give a meta-built model real storage of ``dtype`` on ``device`` (contents undefined).

    The MoE correction bias stays float32: it only ranks experts and bf16 would reorder ties.
    """
    model.to(dtype=dtype)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.nn.Parameter):
            module.e_score_correction_bias = torch.nn.Parameter(bias.float(), requires_grad=False)
    model.to_empty(device=device)


@torch.no_grad()
def stream_weights(info: CheckpointInfo, dests: dict[str, _Destination]) -> None:
    """Copy each on-disk tensor (a sharded one: only this rank's part of it) into its
    destination, one tensor at a time, file by file."""
    by_file: dict[Path, list[str]] = {}
    for name in dests:
        by_file.setdefault(info.files[name], []).append(name)
    for fname, names in by_file.items():
        with safe_open(fname, framework="pt", device="cpu") as f:
            for name in names:
                dest = dests[name]
                if dest.split is None:
                    dest.tensor.copy_(f.get_tensor(name))
                else:
                    dest.tensor.copy_(dest.split.read(f.get_slice(name)))


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    **build_kwargs,
) -> torch.nn.Module:
    """Load a registered architecture from a local HF checkpoint directory.

    ``load_format="dummy"`` reads only ``config.json`` and fills every weight with scaled random
    values directly on ``device`` (vLLM's ``--load-format dummy``: real shapes, no checkpoint).
    ``build_kwargs`` go to the class's ``from_config`` (drafters take the target there).
    """
    if load_format == "dummy":
        return _dummy_model(Path(path), dtype, device, **build_kwargs)
    if load_format != "auto":
        raise ValueError(f"load_format={load_format!r} is not supported; use 'auto' or 'dummy'")
    info = inspect_checkpoint(path)
    cls = resolve_architecture(info.architecture)
    with torch.device("meta"):
        model = cls.from_config(info.config, info.shapes, **build_kwargs)
    materialize(model, dtype, device)
    dests = _select_destinations(model.checkpoint_groups(), set(info.shapes))
    _fail_on_mismatch(info, dests, set(getattr(model, "ignorable_tensors", lambda: ())()))
    stream_weights(info, dests)
    model.eval().requires_grad_(False)
    if hasattr(model, "checkpoint_dir"):
        model.checkpoint_dir = info.path
    if hasattr(model, "post_load"):
        model.post_load()
    logger.info("loaded %s from %s (%s, %s)", info.architecture, path, dtype, device)
    return model


@torch.no_grad()
def _dummy_model(path: Path, dtype: torch.dtype, device, **build_kwargs) -> torch.nn.Module:
    from .random_init import randomize_

    cfg = read_config(path)
    cls = resolve_architecture(cfg["architectures"][0])
    with torch.device("meta"):
        model = cls.from_config(cfg, {}, **build_kwargs)
    materialize(model, dtype, device)
    randomize_(model, seed=0)
    model.eval().requires_grad_(False)
    if hasattr(model, "post_load"):
        model.post_load()
    logger.info("built %s with dummy weights (%s, %s)", cfg["architectures"][0], dtype, device)
    return model
