"""The ``vivace`` command: env twins of flags, and ``generate`` printing its speed."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from vivace.cli import engine_config, main, parse_args
from vivace.config import EngineConfig


def test_env_twin_sets_a_flag_and_the_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIVACE_PORT", "9123")
    monkeypatch.setenv("VIVACE_MAX_MODEL_LEN", "512")
    monkeypatch.setenv("VIVACE_NO_PREFIX_CACHING", "true")
    monkeypatch.setenv("VIVACE_API_KEY", "a,b")
    monkeypatch.setenv("VIVACE_MODEL", "/models/x")
    monkeypatch.setenv("VIVACE_SPECULATIVE", "ngram")
    args = parse_args(["serve"])
    assert (args.port, args.max_model_len, args.api_key, args.model) == (9123, 512, ["a", "b"],
                                                                         "/models/x")
    config = engine_config(args)
    assert config.enable_prefix_caching is False and config.speculative == "ngram"
    args = parse_args(["serve", "other", "--port", "8001", "--api-key", "c"])
    assert (args.port, args.api_key, args.model) == (8001, ["c"], "other")


def test_vllms_prefix_caching_switches_and_the_generation_config_flags(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert engine_config(parse_args(["serve", "--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_config(parse_args(["serve", "--enable-prefix-caching"])).enable_prefix_caching is True
    (tmp_path / "generation_config.json").write_text("{}")
    monkeypatch.setenv("VIVACE_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("VIVACE_GENERATION_CONFIG", str(tmp_path))
    monkeypatch.setenv("VIVACE_OVERRIDE_GENERATION_CONFIG", '{"temperature": 0.5}')
    config = engine_config(parse_args(["serve", "--enable-prefix-caching"]))  # the command line wins over env
    assert config.enable_prefix_caching is True
    assert (config.generation_config, config.override_generation_config) == (str(tmp_path), {"temperature": 0.5})
    config = engine_config(parse_args(["serve", "--generation-config", "vllm", "--override-generation-config", "{}"]))
    assert (config.generation_config, config.override_generation_config, config.chat_template) == ("vllm", {}, None)


def test_bad_generation_config_flags_exit_2_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--generation-config", str(tmp_path), "--port", "1"]) == 2
    assert f"--generation-config {tmp_path}: no generation_config.json there" in capsys.readouterr().err
    assert main(["serve", "--override-generation-config", '{"temperature": "hot"}', "--port", "1"]) == 2
    assert "--override-generation-config: temperature must be a number" in capsys.readouterr().err
    assert main(["serve", "--override-generation-config", '{"top_p": 0}', "--port", "1"]) == 2
    assert "--override-generation-config: top_p must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve", "--override-generation-config", "[0.5]"])
    assert exited.value.code == 2
    assert "argument --override-generation-config: invalid json_object value" in capsys.readouterr().err


def test_defaults_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VIVACE_PORT", "VIVACE_HOST", "VIVACE_MODEL"):
        monkeypatch.delenv(name, raising=False)
    args = parse_args(["serve"])
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, "default", [])
    config = engine_config(args)
    assert (config.compile, config.quantization) == (True, "auto")  # the fast path, as served
    assert engine_config(parse_args(["serve", "--eager"])).compile is False
    monkeypatch.setenv("VIVACE_COMPILE", "0")
    assert engine_config(parse_args(["serve"])).compile is False


def test_the_pacer_is_the_default_and_a_fixed_chunk_or_targets_come_from_flags_or_env(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VIVACE_MAX_PREFILL_CHUNK", "VIVACE_ITL_TARGET_MS", "VIVACE_TTFT_TARGET_MS"):
        monkeypatch.delenv(name, raising=False)
    config = engine_config(parse_args(["serve"]))
    assert (config.max_prefill_chunk, config.itl_target_ms, config.ttft_target_ms) == (None, None, None)
    monkeypatch.setenv("VIVACE_ITL_TARGET_MS", "25")
    monkeypatch.setenv("VIVACE_MAX_PREFILL_CHUNK", "16")
    config = engine_config(parse_args(["serve", "--ttft-target-ms", "800"]))
    assert (config.max_prefill_chunk, config.itl_target_ms, config.ttft_target_ms) == (16, 25.0, 800.0)
    with pytest.raises(ValueError, match="itl_target_ms"):
        engine_config(parse_args(["serve", "--itl-target-ms", "0"]))


def test_bad_env_value_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIVACE_PORT", "eighty")
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve"])
    assert exited.value.code == 2


def test_bench_arguments_pass_through() -> None:
    args = parse_args(["bench", "--url", "http://127.0.0.1:8000", "-n", "3"])
    assert args.command == "bench" and args.bench_args == ["--url", "http://127.0.0.1:8000", "-n", "3"]


TINY_ENGINE = ["--max-model-len", "128", "--num-kv-blocks", "16", "--eager"]


def test_generate_streams_then_prints_speed(tiny_model_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["generate", "Hello there", "--model", str(tiny_model_dir), "--max-tokens", "8",
                   *TINY_ENGINE])
    printed = capsys.readouterr().out
    assert status == 0
    for figure in ("TTFT", "mean ITL", "tokens/s", "bandwidth achieved"):
        assert figure in printed


def test_generate_takes_the_models_defaults_for_flags_not_given(tiny_model_dir: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    def reply(*flags: str) -> str:
        assert main(["generate", "Hello there", "--model", str(tiny_model_dir), "--max-tokens", "8",
                     *TINY_ENGINE, *flags]) == 0
        return capsys.readouterr().out.rsplit("\n\nTTFT", 1)[0]

    greedy = reply("--temperature", "0")
    assert reply("--override-generation-config", '{"top_k": 1}') == greedy  # --temperature 0.7, top_k 1
    assert reply() != greedy


def test_max_model_len_outside_the_models_context_exits_2(tiny_model_dir: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """As vLLM, a context longer than the model's (1024 positions) is refused at start, not
    silently cut to the model's; so is one below a token."""
    assert main(["generate", "hi", "--model", str(tiny_model_dir), "--max-model-len", "1025", "--eager"]) == 2
    assert "--max-model-len 1025 is more than the model's context length (1024" in capsys.readouterr().err
    for length in ("0", "-1"):  # were a context of 0 tokens, and a crash building the rotary tables
        assert main(["generate", "hi", "--model", str(tiny_model_dir), "--max-model-len", length]) == 2
        assert f"max_model_len must be >= 1, got {length}" in capsys.readouterr().err


def test_chat_keeps_the_history(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n/exit\n"))
    status = main(["chat", "--model", str(tiny_model_dir), "--max-tokens", "4", *TINY_ENGINE])
    printed = capsys.readouterr().out
    assert status == 0
    prompt_sizes = [int(total) for total in re.findall(r"/(\d+) prompt tokens cached", printed)]
    assert len(prompt_sizes) == 2 and prompt_sizes[1] > prompt_sizes[0] + 4


def test_tls_flags_and_their_env_twins_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import ssl

    from vivace.cli import server_settings

    monkeypatch.setenv("VIVACE_SSL_KEYFILE", "/tls/key.pem")
    monkeypatch.setenv("VIVACE_SSL_CERTFILE", "/tls/cert.pem")
    settings = server_settings(parse_args(["serve", "--ssl-ca-certs", "/tls/ca.pem"]))
    assert settings.uvicorn_tls() == {"ssl_keyfile": "/tls/key.pem", "ssl_certfile": "/tls/cert.pem",
                                      "ssl_ca_certs": "/tls/ca.pem", "ssl_cert_reqs": ssl.CERT_REQUIRED}
    monkeypatch.delenv("VIVACE_SSL_CERTFILE")
    with pytest.raises(ValueError, match="go together"):
        server_settings(parse_args(["serve"]))


def test_device_flag_and_its_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VIVACE_DEVICE", raising=False)
    assert engine_config(parse_args(["serve"])).device == "auto"
    monkeypatch.setenv("VIVACE_DEVICE", "cpu")
    assert engine_config(parse_args(["serve"])).device == "cpu"
    assert engine_config(parse_args(["serve", "--device", "auto", "--enforce-eager",
                                     "--load-format", "dummy"])).enforce_eager is True
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        engine_config(parse_args(["serve", "--device", "tpu"]))


def test_batch_invariant_flag_and_its_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VIVACE_BATCH_INVARIANT", raising=False)
    assert engine_config(parse_args(["serve"])).batch_invariant is True
    assert engine_config(parse_args(["serve", "--no-batch-invariant"])).batch_invariant is False
    monkeypatch.setenv("VIVACE_BATCH_INVARIANT", "0")
    assert engine_config(parse_args(["serve"])).batch_invariant is False
    assert engine_config(parse_args(["serve", "--batch-invariant"])).batch_invariant is True


def test_fp8_kv_cache_dtype_and_its_alias() -> None:
    for name in ("fp8", "fp8_e4m3"):  # EngineConfig itself: the command line checks for a GPU
        assert EngineConfig(kv_cache_dtype=name, device="cuda").kv_torch_dtype == torch.float8_e4m3fn
    assert parse_args(["serve", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp8', 'fp8_e4m3'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2", device="cuda")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_fp8_kv_cache_on_the_cpu_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--kv-cache-dtype", "fp8", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype fp8 runs on the CUDA backend only" in err
    assert main(["serve", "--kv-cache-dtype", "fp8_e4m3", "--port", "1"]) == 2  # --device auto: the CPU here
    assert "--kv-cache-dtype fp8_e4m3 runs on the CUDA backend only" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_exits_2_naming_the_problem(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cuda", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "no CUDA GPU" in err
    assert main(["generate", "hi", "--device", "cuda"]) == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_quantization_the_device_cannot_run_exits_2_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--device", "auto", "--quantization", "fp8", "--model", "/nowhere"]) == 2
    err = capsys.readouterr().err  # refused before the (missing) model is looked for
    assert "--quantization fp8 runs on CUDA GPUs of compute capability 8.9" in err and "on cpu use int8" in err
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4, fp8"):
        engine_config(parse_args(["serve", "--quantization", "fp4"]))
