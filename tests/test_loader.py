"""Acceptance: the checkpoint loader's errors are clear, and it never holds two copies of the weights.

Every broken checkpoint is a copy of the ``xs_mini`` Laguna fixture with one thing wrong; the
error must be a ``ValueError`` (``CheckpointError`` for what is wrong on disk) whose message
names the offending tensor / field / file and, for tensors, the shapes involved.  Errors are
triggered through the user API (``LLM(model=...)``).

Memory: the loader builds on the meta device, materialises once and streams tensor by tensor
(checked by spies), no parameter lives in a safetensors mmap afterwards, and loading a ~70 MB
checkpoint in a fresh process grows anonymous RSS by about the model size, not twice it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import hf_fixtures as hf
import pytest
import torch

from laguna_dflash import LLM
from laguna_dflash.models import loader
from laguna_dflash.models.loader import CheckpointError, load_model

CONFIG = "xs_mini"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.make_laguna_checkpoint(tmp_path_factory.mktemp("loader") / CONFIG, CONFIG, seed=11)


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the fixture checkpoint for one test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return hf.load_checkpoint_tensors(d)


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _write_config(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _shape_re(*dims: int) -> str:
    """Regex for a shape however it is printed: (48, 128), [48, 128], torch.Size([48, 128])."""
    return r",\s*".join(str(d) for d in dims)


def test_pristine_checkpoint_loads(pristine: Path):
    """Control: the unmodified copy loads (so every error below is caused by the one change)."""
    assert LLM(model=str(pristine)).engine.prompt_logits([5, 6, 7]).shape == (3, 384)


# --------------------------------------------------------------------------------------------
# Tensor errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.1.self_attn.o_proj.weight", (48, 128)),  # 8 heads * 16 on layer 1
        ("model.layers.2.mlp.experts.5.down_proj.weight", (48, 24)),
        ("model.layers.3.mlp.shared_expert.up_proj.weight", (32, 48)),
        ("lm_head.weight", (384, 48)),
    ],
)
def test_missing_tensor_names_it_and_expected_shape(ckpt: Path, name: str, shape: tuple[int, ...]):
    """A tensor deleted from the safetensors file: the error names it and its expected shape."""
    tensors = _tensors(ckpt)
    assert tuple(tensors.pop(name).shape) == shape
    hf.save_checkpoint_tensors(ckpt, tensors)
    with pytest.raises(
        CheckpointError, match=rf"(?s)missing.*{re.escape(name)}.*{_shape_re(*shape)}"
    ):
        LLM(model=str(ckpt))


@pytest.mark.parametrize(
    "name",
    ["model.layers.0.self_attn.extra_proj.weight", "model.layers.4.input_layernorm.weight"],
)
def test_unexpected_tensor_is_named(ckpt: Path, name: str):
    """An extra tensor (unknown module, or a layer beyond num_hidden_layers) is an error naming it."""
    tensors = _tensors(ckpt)
    tensors[name] = torch.ones(3, 48)
    hf.save_checkpoint_tensors(ckpt, tensors)
    with pytest.raises(CheckpointError, match=rf"(?s)unexpected.*{re.escape(name)}"):
        LLM(model=str(ckpt))


def test_integer_weights_are_named_not_cast(ckpt: Path):
    """A quantized export (int8 weights) is an error naming the tensor and its dtype: casting
    the integers to float would load a model that makes no sense."""
    tensors = _tensors(ckpt)
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name].mul(100).to(torch.int8)
    hf.save_checkpoint_tensors(ckpt, tensors)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} \(I8\).*quantized"):
        LLM(model=str(ckpt))


def test_half_precision_weights_load(ckpt: Path):
    tensors = {k: v.to(torch.bfloat16) for k, v in _tensors(ckpt).items()}
    hf.save_checkpoint_tensors(ckpt, tensors)
    assert LLM(model=str(ckpt)).generate(prompt_token_ids=[[1, 2]])[0].token_ids


@pytest.mark.parametrize(
    ("name", "expected", "found"),
    [
        ("model.layers.2.self_attn.k_proj.weight", (32, 48), (32, 47)),
        ("model.layers.1.mlp.experts.3.gate_proj.weight", (24, 48), (25, 48)),
        ("model.layers.0.self_attn.g_proj.weight", (4, 48), (64, 48)),  # per-head declared
        ("model.embed_tokens.weight", (384, 48), (383, 48)),
    ],
)
def test_shape_mismatch_names_tensor_and_both_shapes(
    ckpt: Path, name: str, expected: tuple[int, ...], found: tuple[int, ...]
):
    """A tensor of the wrong shape: the error names it, the expected and the found shape."""
    tensors = _tensors(ckpt)
    assert tuple(tensors[name].shape) == expected
    tensors[name] = torch.zeros(found)
    hf.save_checkpoint_tensors(ckpt, tensors)
    with pytest.raises(CheckpointError) as info:
        LLM(model=str(ckpt))
    message = str(info.value)
    assert name in message
    assert re.search(_shape_re(*expected), message), message
    assert re.search(_shape_re(*found), message), message


def test_index_pointing_at_missing_shard_names_the_shard(ckpt: Path):
    """A sharded checkpoint whose index maps tensors to a shard file that is gone."""
    files = hf.shard_checkpoint(ckpt, 3)
    files[1].unlink()
    with pytest.raises(CheckpointError, match=rf"(?s)missing.*{re.escape(files[1].name)}"):
        LLM(model=str(ckpt))


def test_index_mapping_tensor_to_wrong_shard_is_an_error(ckpt: Path):
    """The index says a tensor is in a shard that does not contain it: an error naming it."""
    hf.shard_checkpoint(ckpt, 2)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    name = "model.layers.3.self_attn.q_proj.weight"
    shards = sorted(set(weight_map.values()))
    weight_map[name] = next(s for s in shards if s != weight_map[name])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        LLM(model=str(ckpt))


def test_malformed_index_is_an_error(ckpt: Path):
    """An index json without ``weight_map`` says so."""
    hf.shard_checkpoint(ckpt, 2)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        LLM(model=str(ckpt))


# --------------------------------------------------------------------------------------------
# Directory / config errors
# --------------------------------------------------------------------------------------------


def test_unknown_architecture_lists_supported(ckpt: Path):
    """An unregistered ``architectures`` entry: named, with the supported ones listed."""
    cfg = _config(ckpt)
    cfg["architectures"] = ["FooBarForCausalLM"]
    _write_config(ckpt, cfg)
    with pytest.raises(ValueError) as info:
        LLM(model=str(ckpt))
    message = str(info.value)
    for needle in ("FooBarForCausalLM", "LagunaForCausalLM", "Qwen3ForCausalLM"):
        assert needle in message, message


def test_invalid_json_config(ckpt: Path):
    """config.json that does not parse: says it is not valid JSON and names the file."""
    (ckpt / "config.json").write_text('{"architectures": ["LagunaForCausalLM"], "hidden_size": ')
    with pytest.raises(CheckpointError, match=r"(?s)config\.json.*JSON"):
        LLM(model=str(ckpt))


@pytest.mark.parametrize("value", ["<absent>", [], "LagunaForCausalLM", [None]])
def test_missing_or_malformed_architectures(ckpt: Path, value):
    """No usable ``architectures`` list: the message says ``architectures`` is needed."""
    cfg = _config(ckpt)
    if value == "<absent>":
        del cfg["architectures"]
    else:
        cfg["architectures"] = value
    _write_config(ckpt, cfg)
    with pytest.raises(CheckpointError, match="architectures"):
        LLM(model=str(ckpt))


def test_config_json_not_an_object(ckpt: Path):
    """A JSON array instead of an object is rejected with a message about config.json."""
    (ckpt / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        LLM(model=str(ckpt))


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"]
)
def test_missing_required_field_is_named(ckpt: Path, field: str):
    """A required config field that is absent: the error names the field."""
    cfg = _config(ckpt)
    del cfg[field]
    _write_config(ckpt, cfg)
    with pytest.raises(
        ValueError,
        match=rf"(?s){field}.*(missing|lacks|required)|(missing|lacks|required).*{field}",
    ):
        LLM(model=str(ckpt))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", "48"),
        ("num_hidden_layers", 2.5),
        ("vocab_size", [384]),
        ("num_experts", "8"),
        ("rms_norm_eps", "1e-6x"),
        ("sliding_window", "seven"),
        ("tie_word_embeddings", "false"),
    ],
)
def test_wrong_type_field_is_named(ckpt: Path, field: str, value):
    """A config field of the wrong type is a ValueError that names the field (not a TypeError
    from deep inside, a bare ``int()``/``float()`` message, or a silently different model)."""
    cfg = _config(ckpt)
    cfg[field] = value
    _write_config(ckpt, cfg)
    with pytest.raises(ValueError, match=re.escape(field)):
        LLM(model=str(ckpt))


def test_wrong_length_per_layer_list_is_named(ckpt: Path):
    """``num_attention_heads_per_layer`` with the wrong number of entries names the field."""
    cfg = _config(ckpt)
    cfg["num_attention_heads_per_layer"] = [4, 8]
    _write_config(ckpt, cfg)
    with pytest.raises(ValueError, match="num_attention_heads_per_layer"):
        LLM(model=str(ckpt))


def test_directory_without_weights(ckpt: Path):
    """config.json but no safetensors: says there are no weights and what file is expected."""
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"(?s)no weights.*model\.safetensors"):
        LLM(model=str(ckpt))


def test_directory_without_config(ckpt: Path):
    """Weights but no config.json: says config.json is missing."""
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        LLM(model=str(ckpt))


def test_nonexistent_path(tmp_path: Path):
    """A path that does not exist: the error names the path."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        LLM(model=str(missing))


def test_path_is_a_file(ckpt: Path):
    """A file instead of a directory (e.g. the safetensors file itself) is rejected clearly."""
    path = ckpt / "model.safetensors"
    with pytest.raises(CheckpointError, match=r"(?s)not a directory"):
        LLM(model=str(path))


# --------------------------------------------------------------------------------------------
# One copy of the weights
# --------------------------------------------------------------------------------------------


class _HandleSpy:
    """Wraps a ``safe_open`` handle: counts ``get_tensor`` per name, tracks the fetched tensors."""

    def __init__(self, handle, log: dict) -> None:
        self._handle = handle
        self._log = log

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def __getattr__(self, attr):
        return getattr(self._handle, attr)

    def get_tensor(self, name: str):
        alive = [r for r in self._log["fetched"] if r() is not None]
        self._log["max_alive"] = max(self._log["max_alive"], len(alive))
        tensor = self._handle.get_tensor(name)
        self._log["calls"][name] = self._log["calls"].get(name, 0) + 1
        self._log["fetched"].append(weakref.ref(tensor))
        return tensor


@pytest.mark.parametrize("sharded", [False, True])
def test_load_builds_on_meta_and_streams_each_tensor_once(
    pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool
):
    """``load_model`` builds the model on the meta device, gives it storage with ``to_empty``,
    then reads every on-disk tensor exactly once (``get_tensor``), never holding more than a
    couple of fetched tensors alive at a time, i.e. no full state dict in memory."""
    d = Path(shutil.copytree(pristine, tmp_path / "c"))
    if sharded:
        hf.shard_checkpoint(d, 3, interleave=True)
    on_disk = set(_tensors(d))
    log: dict = {"calls": {}, "fetched": [], "max_alive": 0, "to_empty": []}
    real_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: _HandleSpy(real_open(*a, **k), log))
    real_to_empty = torch.nn.Module.to_empty

    def to_empty(self, *args, **kwargs):
        log["to_empty"].append({p.device.type for p in self.parameters()})
        return real_to_empty(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    model = load_model(d)
    assert log["to_empty"], "to_empty was never called: the model was not built on meta"
    assert log["to_empty"][0] == {"meta"}, f"parameters before to_empty: {log['to_empty'][0]}"
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert set(log["calls"]) == on_disk, on_disk ^ set(log["calls"])
    repeated = {n: c for n, c in log["calls"].items() if c != 1}
    assert not repeated, f"tensors read more than once: {repeated}"
    assert log["max_alive"] <= 2, f"{log['max_alive']} fetched tensors alive at once"


def _safetensors_maps(directory: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of safetensors files under ``directory``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(str(directory)) and ".safetensors" in parts[5]:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_parameters_do_not_live_in_the_safetensors_mmap(pristine: Path, tmp_path: Path):
    """After load no parameter's storage lies inside a mapping of the checkpoint files (the
    files are closed and unmapped), and rewriting the files on disk does not change the model."""
    d = Path(shutil.copytree(pristine, tmp_path / "c"))
    model = load_model(d)
    ranges = _safetensors_maps(d)
    for name, p in model.state_dict().items():
        ptr = p.untyped_storage().data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in ranges), f"{name} is backed by the mmap"
    assert not ranges, f"checkpoint files still mapped after load: {ranges}"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hf.save_checkpoint_tensors(d, {k: torch.zeros_like(v) for k, v in _tensors(d).items()})
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed when the file changed"


_RSS_SCRIPT = textwrap.dedent(
    r"""
    import gc, json, sys, threading, time
    import torch
    torch.set_num_threads(1)
    from laguna_dflash.models import loader
    import laguna_dflash.models.laguna  # the lazy registry import is not part of the load

    def status_kib(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise RuntimeError("no " + key)

    def anon_kib():
        return status_kib("RssAnon")

    peak = [0]
    real_open = loader.safe_open

    class Spy:
        def __init__(self, h):
            self.h = h
        def __enter__(self):
            self.h.__enter__()
            return self
        def __exit__(self, *e):
            return self.h.__exit__(*e)
        def __getattr__(self, a):
            return getattr(self.h, a)
        def get_tensor(self, name):
            t = self.h.get_tensor(name)
            peak[0] = max(peak[0], anon_kib())
            return t

    # Warm-up: the first model build pays one-off lazy initialisation (~70 MB of torch state).
    loader.load_model(sys.argv[1])
    loader.safe_open = lambda *a, **k: Spy(real_open(*a, **k))
    gc.collect()
    base, base_rss = anon_kib(), status_kib("VmRSS")
    done = threading.Event()

    def poll():  # also catches a peak between get_tensor calls or without them
        while not done.is_set():
            peak[0] = max(peak[0], anon_kib())
            time.sleep(0.0005)

    sys.setswitchinterval(0.0005)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    model = loader.load_model(sys.argv[2])
    done.set()
    poller.join()
    gc.collect()
    after, after_rss = anon_kib(), status_kib("VmRSS")
    peak[0] = max(peak[0], after)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"base": base, "after": after, "peak": peak[0], "model_kib": nbytes // 1024,
                      "rss_grown": after_rss - base_rss}))
    """
)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~70 MB fp32 random Laguna checkpoint written by the package's random_init helpers."""
    from laguna_dflash.models.laguna import LagunaForCausalLM
    from laguna_dflash.models.random_init import randomize_, tiny_laguna_config
    from laguna_dflash.models.writer import save_checkpoint

    cfg = tiny_laguna_config(vocab_size=8192, num_layers=8, hidden_size=256)
    model = LagunaForCausalLM.from_config(cfg)
    randomize_(model, seed=0)
    d = save_checkpoint(model, tmp_path_factory.mktemp("big") / "ckpt", cfg)
    del model
    return d


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_rss_growth_is_about_one_model_copy(pristine: Path, big_checkpoint: Path):
    """In a fresh process (after loading a tiny checkpoint once to warm torch up), loading a
    ~70 MB checkpoint grows RSS by at most 1.5x the model's bytes: anonymous memory at its peak
    during streaming (polled) and after the load, and total RSS after the load (a state dict
    kept alive, copied or still mmapped, would be ~2x)."""
    size = (big_checkpoint / "model.safetensors").stat().st_size
    assert 50e6 < size < 100e6, f"checkpoint is {size / 1e6:.0f} MB"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(pristine), str(big_checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    model_kib = m["model_kib"]
    assert model_kib * 1024 > 0.9 * size
    grown_after = m["after"] - m["base"]
    grown_peak = m["peak"] - m["base"]
    assert grown_after <= 1.5 * model_kib, f"RSS grew {grown_after} KiB for a {model_kib} KiB model"
    assert grown_peak <= 1.5 * model_kib, f"peak RSS grew {grown_peak} KiB for {model_kib} KiB"
    assert m["rss_grown"] <= 1.5 * model_kib, (
        f"total RSS (incl. file-backed mmap pages) grew {m['rss_grown']} KiB for {model_kib} KiB"
    )
    assert grown_after >= 0.8 * model_kib, "measurement broken: the weights are not in RSS"


# --------------------------------------------------------------------------------------------
# Corrupt files and malformed fields: CheckpointError / ValueError, not a library exception
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(ckpt: Path, damage: str):
    """A truncated download or a file that is not safetensors at all: a CheckpointError (which
    the CLI reports on one line) naming the file, not safetensors' own exception."""
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(re-download|re-export)"):
        LLM(model=str(ckpt))


def test_corrupt_shard_names_the_shard(ckpt: Path):
    files = hf.shard_checkpoint(ckpt, 2)
    files[1].write_bytes(files[1].read_bytes()[:100])
    with pytest.raises(CheckpointError, match=re.escape(files[1].name)):
        LLM(model=str(ckpt))


@pytest.mark.parametrize("index", [{"weight_map": ["a"]}, [1], {"weight_map": {"x": 3}}])
def test_index_of_the_wrong_shape_is_an_error(ckpt: Path, index):
    hf.shard_checkpoint(ckpt, 2)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="weight_map"):
        LLM(model=str(ckpt))


def test_more_experts_per_token_than_experts_is_named(ckpt: Path):
    """``num_experts_per_tok > num_experts`` is a config error at load time, not a torch.topk
    failure in the first step."""
    cfg = _config(ckpt)
    cfg["num_experts_per_tok"] = cfg["num_experts"] + 1
    _write_config(ckpt, cfg)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LLM(model=str(ckpt))


@pytest.mark.parametrize("eos", ["12", [1, "x"], 1.5])
def test_malformed_eos_token_id_is_named(ckpt: Path, eos):
    cfg = _config(ckpt)
    cfg["eos_token_id"] = eos
    _write_config(ckpt, cfg)
    with pytest.raises(ValueError, match="eos_token_id"):
        LLM(model=str(ckpt))
