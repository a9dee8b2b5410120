"""``serve`` flag resolution: the three speculative spellings, conflicts, the one start-up log line.

No server and no model are started here: these call the resolution functions directly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from laguna_dflash.cli import build_parser, main
from laguna_dflash.server.args import (
    API_KEY_ENV,
    resolve_server_config,
    resolve_speculative,
)


def _args(*flags: str):
    return build_parser().parse_args(["serve", "--model", "/models/target", *flags])


def _draft_dir(tmp_path: Path, block_size: int = 16) -> str:
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"architectures": ["DFlashLagunaForCausalLM"], "dflash_config": {"block_size": block_size}}))
    return str(d)


def test_vllm_spelling():
    spec = resolve_speculative(_args(
        "--speculative-config", '{"method": "dflash", "model": "/d", "num_speculative_tokens": 15}'))
    assert spec.config.draft == "/d" and spec.config.num_speculative_tokens == 15
    assert spec.draft_flag == "--speculative-config model"


def test_vllm_spelling_without_method_or_k():
    spec = resolve_speculative(_args("--speculative-config", '{"model": "/d"}'))
    assert spec.config.draft == "/d" and spec.config.num_speculative_tokens is None


def test_sglang_spelling_counts_the_bonus_slot():
    spec = resolve_speculative(_args(
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d",
        "--speculative-num-draft-tokens", "16"))
    assert spec.config.draft == "/d"
    assert spec.config.num_speculative_tokens == 15  # 16 verify slots = bonus + 15 drafts


def test_sglang_block_size_flag_is_a_synonym():
    spec = resolve_speculative(_args(
        "--speculative-algorithm", "dflash", "--speculative-draft-model-path", "/d",
        "--speculative-dflash-block-size", "8"))
    assert spec.config.num_speculative_tokens == 7


def test_own_spelling():
    spec = resolve_speculative(_args("--draft", "/d", "--num-speculative-tokens", "5"))
    assert spec.config.draft == "/d" and spec.config.num_speculative_tokens == 5
    assert spec.draft_flag == "--draft" and spec.tokens_flag == "--num-speculative-tokens"


def test_no_speculation_by_default_and_with_no_spec():
    assert resolve_speculative(_args()).config is None
    assert resolve_speculative(_args("--draft", "/d", "--no-spec")).config is None


def test_draft_tensor_parallel_size_from_the_flag_or_vllms_key():
    assert resolve_speculative(_args("--draft", "/d")).config.draft_tensor_parallel_size is None
    spec = resolve_speculative(_args("--draft", "/d", "--draft-tensor-parallel-size", "1"))
    assert spec.config.draft_tensor_parallel_size == 1
    spec = resolve_speculative(_args(
        "--speculative-config", '{"model": "/d", "draft_tensor_parallel_size": 2}',
        "--draft-tensor-parallel-size", "2"))
    assert spec.config.draft_tensor_parallel_size == 2


def test_draft_tensor_parallel_size_in_the_resolved_settings():
    def shown(*flags: str):
        return resolve_server_config(_args(*flags)).describe()["draft_tensor_parallel_size"]

    assert shown("--draft", "/d") is None  # one rank: nothing to shard
    assert shown("--draft", "/d", "--tensor-parallel-size", "2").startswith("auto")
    assert shown("--draft", "/d", "--tensor-parallel-size", "2", "--draft-tensor-parallel-size", "1") == 1
    assert shown("--tensor-parallel-size", "2") is None


def test_spellings_that_agree_may_be_mixed():
    spec = resolve_speculative(_args(
        "--draft", "/d/", "--speculative-config", '{"model": "/d", "num_speculative_tokens": 15}',
        "--speculative-num-draft-tokens", "16"))
    assert spec.config.draft == "/d" and spec.config.num_speculative_tokens == 15


@pytest.mark.parametrize("flags, first, second", [
    (("--draft", "/a", "--speculative-config", '{"model": "/b"}'),
     "--draft", "--speculative-config"),
    (("--draft", "/a", "--speculative-draft-model-path", "/b", "--speculative-algorithm", "DFLASH"),
     "--draft", "--speculative-draft-model-path"),
    (("--speculative-config", '{"model": "/a"}', "--speculative-draft-model-path", "/b"),
     "--speculative-config", "--speculative-draft-model-path"),
    (("--draft", "/a", "--num-speculative-tokens", "7", "--speculative-num-draft-tokens", "16"),
     "--num-speculative-tokens", "--speculative-num-draft-tokens"),
    (("--speculative-config", '{"model": "/a", "num_speculative_tokens": 15}',
      "--speculative-draft-model-path", "/a", "--speculative-num-draft-tokens", "8"),
     "--speculative-config", "--speculative-num-draft-tokens"),
    (("--draft", "/a", "--speculative-num-draft-tokens", "16",
      "--speculative-dflash-block-size", "8"),
     "--speculative-num-draft-tokens", "--speculative-dflash-block-size"),
    (("--speculative-config", '{"model": "/a", "draft_tensor_parallel_size": 1}',
      "--draft-tensor-parallel-size", "2"),
     "--draft-tensor-parallel-size", "--speculative-config draft_tensor_parallel_size"),
])
def test_conflicting_spellings_name_both_flags(flags, first, second):
    with pytest.raises(ValueError, match="conflicting") as info:
        resolve_speculative(_args(*flags))
    assert first in str(info.value) and second in str(info.value)


@pytest.mark.parametrize("flags, needle", [
    (("--speculative-config", '{"method": "eagle", "model": "/d"}'), "method 'eagle'"),
    (("--speculative-config", "{not json"), "--speculative-config is not valid JSON"),
    (("--speculative-config", '["/d"]'), "must be a JSON object"),
    (("--speculative-config", '{"method": "dflash"}'), 'needs "model"'),
    (("--speculative-config", '{"model": "/d", "num_speculative_tokens": "x"}'),
     "num_speculative_tokens must be a JSON integer, got 'x'"),
    (("--speculative-config", '{"model": "/d", "num_speculative_tokens": 2.7}'),
     "num_speculative_tokens must be a JSON integer, got 2.7"),
    (("--speculative-config", '{"model": "/d", "num_speculative_tokens": true}'),
     "num_speculative_tokens must be a JSON integer, got True"),
    (("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d"), "EAGLE"),
    (("--speculative-algorithm", "DFLASH"), "requires --speculative-draft-model-path"),
    (("--draft", "/d", "--speculative-num-draft-tokens", "1"), "must be >= 2"),
    (("--num-speculative-tokens", "3",), "--num-speculative-tokens needs a drafter"),
    (("--speculative-num-draft-tokens", "16",), "--speculative-num-draft-tokens needs a drafter"),
    (("--draft-tensor-parallel-size", "1",), "--draft-tensor-parallel-size needs a drafter"),
    (("--draft", "/d", "--draft-tensor-parallel-size", "0"),
     "draft_tensor_parallel_size must be an integer >= 1 (--draft-tensor-parallel-size"),
    (("--speculative-config", '{"model": "/d", "draft_tensor_parallel_size": "2"}'),
     "draft_tensor_parallel_size must be a JSON integer"),
])
def test_bad_speculative_flags(flags, needle):
    with pytest.raises(ValueError) as info:
        resolve_speculative(_args(*flags))
    assert needle in str(info.value)


def test_resolved_config_defaults_and_single_log_line(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    draft = _draft_dir(tmp_path, block_size=16)
    caplog.set_level(logging.INFO, logger="laguna_dflash.server.args")
    config = resolve_server_config(_args("--speculative-config", json.dumps({"model": draft})))
    assert config.host == "127.0.0.1" and config.port == 8000  # loopback by default
    assert config.served_model_name == "/models/target" and config.api_key is None
    assert config.engine.speculative.draft == draft
    described = config.describe()
    assert described["num_speculative_tokens"] == 15  # from the drafter's block_size 16
    assert described["num_speculative_tokens_from"] == "drafter block_size"
    lines = [r.getMessage() for r in caplog.records if "resolved serve configuration" in r.getMessage()]
    assert len(lines) == 1
    assert "num_speculative_tokens=15" in lines[0] and "draft_from=--speculative-config" in lines[0]
    assert "api_key=none" in lines[0]


def test_api_key_from_environment_is_not_logged(caplog, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    caplog.set_level(logging.INFO, logger="laguna_dflash.server.args")
    config = resolve_server_config(_args("--served-model-name", "laguna"))
    assert config.api_key == "s3cret" and config.served_model_name == "laguna"
    assert "s3cret" not in caplog.text and "s3cret" not in repr(config)


def test_cli_serve_conflict_exits_with_an_error_naming_both_flags(capsys):
    code = main(["serve", "--model", "/models/target", "--draft", "/a",
                 "--speculative-draft-model-path", "/b", "--speculative-algorithm", "DFLASH"])
    err = capsys.readouterr().err
    assert code == 2 and "--draft" in err and "--speculative-draft-model-path" in err


def test_engine_flags_reach_the_engine_config_and_the_log_line(caplog):
    caplog.set_level(logging.INFO, logger="laguna_dflash.server.args")
    config = resolve_server_config(_args("--load-format", "dummy", "--enforce-eager",
                                         "--attention-backend", "torch_sdpa", "--batch-invariant",
                                         "--enable-expert-parallel"))
    assert config.engine.load_format == "dummy" and config.engine.enable_expert_parallel is True
    assert config.engine.enforce_eager is True and config.engine.attention_backend == "torch_sdpa"
    assert config.engine.batch_invariant is True
    line = next(r.getMessage() for r in caplog.records if "resolved serve configuration" in r.getMessage())
    assert "load_format=dummy" in line and "enforce_eager=True" in line and "batch_invariant=True" in line
    assert "enable_expert_parallel=True" in line
    default = resolve_server_config(_args()).engine
    assert default.load_format == "auto" and default.batch_invariant is False
    assert default.enable_expert_parallel is False


def test_chat_template_flag_takes_a_file_or_the_template_and_names_a_missing_file(tmp_path):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert resolve_server_config(_args("--chat-template", str(path))).chat_template == template
    config = resolve_server_config(_args("--chat-template", template,
                                         "--trust-request-chat-template"))
    assert config.chat_template == template and config.trust_request_chat_template
    assert config.describe()["chat_template"] == "--chat-template"
    plain = resolve_server_config(_args())
    assert plain.chat_template is None and not plain.trust_request_chat_template
    with pytest.raises(ValueError, match="--chat-template .*no such file"):
        resolve_server_config(_args("--chat-template", str(tmp_path / "missing.jinja")))


def test_max_logprobs_flag_reaches_the_engine_config():
    assert resolve_server_config(_args()).engine.max_logprobs == 20
    assert resolve_server_config(_args("--max-logprobs", "-1")).engine.max_logprobs == -1
    with pytest.raises(ValueError, match="max_logprobs must be"):
        resolve_server_config(_args("--max-logprobs", "-5"))


def test_mem_fraction_static_flag_reaches_the_engine_config_and_the_log_line(caplog):
    """--mem-fraction-static (SGLang's) reaches EngineConfig and the start-up line; unset it
    says the default rule; out of (0, 1] it is an error naming the flag."""
    config = resolve_server_config(_args("--mem-fraction-static", "0.85"))
    assert config.engine.mem_fraction_static == 0.85
    assert config.describe()["mem_fraction_static"] == 0.85
    default = resolve_server_config(_args())
    assert default.engine.mem_fraction_static is None
    assert "80%" in default.describe()["mem_fraction_static"]
    for bad in ("0", "1.5"):
        with pytest.raises(ValueError, match="--mem-fraction-static"):
            resolve_server_config(_args("--mem-fraction-static", bad))


def test_gpu_memory_utilization_flag_reaches_the_engine_config_and_the_log_line():
    """--gpu-memory-utilization (vLLM's) reaches EngineConfig and the start-up line; out of
    (0, 1], or set with --mem-fraction-static, it is an error naming the flags."""
    config = resolve_server_config(_args("--gpu-memory-utilization", "0.9"))
    assert config.engine.gpu_memory_utilization == 0.9
    assert config.describe()["gpu_memory_utilization"] == 0.9
    assert config.describe()["mem_fraction_static"] == "unset"
    assert resolve_server_config(_args()).engine.gpu_memory_utilization is None
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(ValueError, match="--gpu-memory-utilization"):
            resolve_server_config(_args("--gpu-memory-utilization", bad))
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*--mem-fraction-static.*set one"):
        resolve_server_config(_args("--gpu-memory-utilization", "0.9", "--mem-fraction-static", "0.8"))


def test_cuda_graph_max_bs_flag_reaches_the_engine_config_and_the_log_line(caplog):
    caplog.set_level(logging.INFO, logger="laguna_dflash.server.args")
    config = resolve_server_config(_args("--cuda-graph-max-bs", "16"))
    assert config.engine.cuda_graph_max_bs == 16
    line = next(r.getMessage() for r in caplog.records if "resolved serve configuration" in r.getMessage())
    assert "cuda_graph_max_bs=16" in line
    default = resolve_server_config(_args("--max-num-seqs", "32"))
    assert default.engine.cuda_graph_max_bs is None
    assert default.describe()["cuda_graph_max_bs"] == "max_num_seqs, at most 256 (32)"
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        resolve_server_config(_args("--cuda-graph-max-bs", "0"))


def test_generation_config_flag_takes_vllms_choices(tmp_path):
    """``--generation-config``: auto reads the model's file, vllm / none give no defaults, a
    directory gives its file's (vLLM's choices; before, only auto | none parsed), and a
    directory without the file is an error naming the flag."""
    model, other = tmp_path / "model", tmp_path / "other"
    for d, top_k in ((model, 20), (other, 7)):
        d.mkdir()
        (d / "generation_config.json").write_text(json.dumps({"top_k": top_k, "temperature": 0.6}))

    def defaults(*flags: str) -> dict:
        args = build_parser().parse_args(["serve", "--model", str(model), *flags])
        return resolve_server_config(args).generation_defaults

    assert defaults() == defaults("--generation-config", "auto") == {"top_k": 20, "temperature": 0.6}
    assert defaults("--generation-config", "vllm") == defaults("--generation-config", "none") == {}
    assert defaults("--generation-config", str(other)) == {"top_k": 7, "temperature": 0.6}
    with pytest.raises(ValueError, match="--generation-config .*no generation_config.json there"):
        defaults("--generation-config", str(tmp_path))
    # max_new_tokens is kept (it caps each request's max_tokens); a bad one fails at start-up
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 64}))
    assert defaults("--generation-config", str(other)) == {"max_tokens": 64}
    for bad in (0, -1, 2.5, True, "64"):
        (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": bad}))
        with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1.*--generation-config vllm"):
            defaults("--generation-config", str(other))


def test_disable_hybrid_kv_cache_manager_flag_reaches_the_engine_config_and_generate():
    """vLLM's flag, for serve (EngineConfig and the start-up line) and generate / bench."""
    from laguna_dflash.cli import build_parser, engine_options

    assert not resolve_server_config(_args()).engine.disable_hybrid_kv_cache_manager
    config = resolve_server_config(_args("--disable-hybrid-kv-cache-manager"))
    assert config.engine.disable_hybrid_kv_cache_manager
    assert config.describe()["disable_hybrid_kv_cache_manager"] is True
    args = build_parser().parse_args(["generate", "--model", "m", "--disable-hybrid-kv-cache-manager", "x"])
    assert engine_options(args)["disable_hybrid_kv_cache_manager"] is True


def test_dtype_defaults_to_auto_as_in_vllm():
    """``serve`` / ``generate`` / ``bench`` default to ``--dtype auto`` (vLLM's): float32 on the
    CPU as before, the checkpoint's bf16 on a GPU (the default was float32 there, doubling the
    weights' memory and the bytes a decode step reads)."""
    import torch

    from laguna_dflash.cli import build_parser
    from laguna_dflash.config import resolve_dtype

    for cmd in (["serve", "--model", "m"], ["generate", "--model", "m", "x"], ["bench", "--model", "m"]):
        assert build_parser().parse_args(cmd).dtype == "auto", cmd
    assert resolve_server_config(_args()).engine.dtype == "auto"
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, torch.device("cuda")) == torch.bfloat16


def test_serve_takes_the_model_positionally_as_vllm_serve_does(tmp_path):
    """``laguna-dflash serve MODEL`` (vLLM's ``vllm serve MODEL``) equals ``--model MODEL``;
    both agreeing is fine, disagreeing or neither is an error naming the fix."""
    from laguna_dflash.cli import build_parser

    def config(*argv: str):
        return resolve_server_config(build_parser().parse_args(["serve", *argv]))

    assert config("/models/t").engine.model == config("--model", "/models/t").engine.model == "/models/t"
    assert config("/models/t", "--model", "/models/t/").engine.model == "/models/t/"  # the same dir
    assert config("/models/t", "--port", "9").served_model_name == "/models/t"
    with pytest.raises(ValueError, match="give the model once: serve /a and --model /b disagree"):
        config("/a", "--model", "/b")
    with pytest.raises(ValueError, match="serve needs the target model: laguna-dflash serve MODEL_DIR"):
        config()


def test_vllm_launch_line_flags_run_unchanged(monkeypatch):
    """Flags vLLM / SGLang launch lines carry: --trust-remote-code (no effect: nothing from a
    checkpoint is run), --disable-log-stats (= --log-stats-interval 0), --disable-log-requests
    (requests are not logged by default), --uvicorn-log-level, and vLLM's VLLM_API_KEY after
    ours. Each used to be an argparse error (or, for the variable, ignored)."""
    from laguna_dflash.cli import build_parser

    monkeypatch.delenv("LAGUNA_DFLASH_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    plain = resolve_server_config(_args())
    config = resolve_server_config(_args("--trust-remote-code", "--disable-log-stats",
                                         "--disable-log-requests", "--uvicorn-log-level", "debug"))
    assert plain.log_stats_interval_s == 10.0 and config.log_stats_interval_s == 0.0
    assert plain.uvicorn_log_level == "info" and config.uvicorn_log_level == "debug"
    assert not config.log_requests and resolve_server_config(_args("--enable-log-requests")).log_requests
    assert plain.api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert resolve_server_config(_args()).api_key == "from-vllm"
    monkeypatch.setenv("LAGUNA_DFLASH_API_KEY", "ours")
    assert resolve_server_config(_args()).api_key == "ours"
    assert resolve_server_config(_args("--api-key", "flag")).api_key == "flag"
    for cmd in (["generate", "--trust-remote-code", "x"], ["bench", "--trust-remote-code"]):
        assert build_parser().parse_args(cmd).trust_remote_code
