"""The model's recommended sampling defaults (``--generation-config``): what is read from where,
how ``--override-generation-config`` merges on top, and how a request's own values win."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest

from vivace.config import EngineConfig
from vivace.generation_config import model_recommendations, sampling_defaults, served_defaults
from vivace.server.errors import APIError
from vivace.server.prompts import fit_max_tokens
from vivace.server.protocol import ChatCompletionRequest, CompletionRequest

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def _folder(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_takes_the_models_sampling_fields_and_max_new_tokens_as_max_tokens(tmp_path: Path) -> None:
    model = _folder(tmp_path, "qwen3", {**QWEN3, "min_p": None, "repetition_penalty": 1.05, "max_new_tokens": 512})
    assert sampling_defaults("auto", model, {}) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05, "max_tokens": 512}
    assert model_recommendations(tmp_path / "nowhere") == {}
    assert sampling_defaults("auto", _folder(tmp_path, "plain", {"eos_token_id": 2}), {}) == {}


def test_vllm_takes_none_a_folder_its_own_and_the_override_wins(tmp_path: Path) -> None:
    model = _folder(tmp_path, "model", QWEN3)
    other = _folder(tmp_path, "other", {"temperature": 0.3, "min_p": 0.1})
    assert sampling_defaults("vllm", model, {}) == {}
    assert sampling_defaults(str(other), model, {}) == {"temperature": 0.3, "min_p": 0.1}
    assert sampling_defaults("auto", model, {"temperature": 0.5, "max_new_tokens": 64}) == {
        "temperature": 0.5, "top_k": 20, "top_p": 0.95, "max_tokens": 64}
    assert sampling_defaults("vllm", model, {"top_k": 1}) == {"top_k": 1}


@pytest.mark.parametrize(("config", "error"), [
    ({"top_k": 1.5}, "top_k must be an integer, got 1.5"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": True}, "top_p must be a number"),
])
def test_a_field_that_is_not_a_number_is_refused_naming_the_file(tmp_path: Path, config: dict, error: str) -> None:
    model = _folder(tmp_path, "model", config)
    with pytest.raises(ValueError, match=f"generation_config.json: {error}"):
        sampling_defaults("auto", model, {})
    (model / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        sampling_defaults("auto", model, {})


def test_engine_config_checks_the_flags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"--generation-config {tmp_path}: no generation_config.json there"):
        EngineConfig(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="--override-generation-config: unknown field 'temp'"):
        EngineConfig(override_generation_config={"temp": 0.5})
    assert EngineConfig(generation_config=str(_folder(tmp_path, "x", {}))).generation_config == str(tmp_path / "x")


def test_served_defaults_refuse_values_the_engine_would_and_log_what_they_apply(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _folder(tmp_path, "model", QWEN3)
    with caplog.at_level(logging.INFO, logger="vivace.generation_config"):
        assert served_defaults(EngineConfig(), model) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert [r.getMessage() for r in caplog.records] == [
        "vivace: default sampling parameters from the model's generation config (auto), for requests that leave "
        "them out: temperature=0.6, top_k=20, top_p=0.95 (--generation-config vllm turns this off)"]
    caplog.clear()
    assert served_defaults(EngineConfig(generation_config="vllm"), model) == {}
    assert not caplog.records
    with pytest.raises(ValueError, match="--generation-config auto: top_p must be in"):
        served_defaults(EngineConfig(override_generation_config={"top_p": 0}), model)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        served_defaults(EngineConfig(override_generation_config={"max_new_tokens": 0}), model)


def test_a_gguf_recommends_its_general_sampling_keys(tmp_path: Path) -> None:
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert model_recommendations(path) == {"temperature": 0.25, "top_k": 40, "repetition_penalty": 1.5}


def test_a_requests_own_values_win_null_and_left_out_take_the_defaults() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 512}
    messages = [{"role": "user", "content": "hi"}]
    left_out = ChatCompletionRequest.model_validate({"messages": messages})
    params = left_out.sampling_params(16, None, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.6, 0.95, 20, 0.0, 1.0)
    nulls = ChatCompletionRequest.model_validate_json(json.dumps(
        {"messages": messages, "temperature": None, "top_k": None, "top_p": 1.0}))
    params = nulls.sampling_params(16, None, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 1.0, 20)  # an explicit 1.0 wins
    plain = left_out.sampling_params(16, None)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0)


def test_the_default_max_tokens_applies_to_left_out_or_null_and_fits_the_room() -> None:
    assert fit_max_tokens(10, None, 100, "messages", 32) == 32
    assert fit_max_tokens(10, None, 30, "messages", 32) == 20  # the default shrinks to the room left
    assert fit_max_tokens(10, 50, 100, "messages", 32) == 50
    assert fit_max_tokens(10, None, 100, "messages") == 90
    with pytest.raises(APIError, match="maximum context length is 30"):
        fit_max_tokens(10, 50, 30, "messages", 8)
    left_out = CompletionRequest.model_validate({"prompt": "hi"})
    null = CompletionRequest.model_validate_json('{"prompt": "hi", "max_tokens": null}')
    given = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 16})
    assert [r.requested_max_tokens(False) for r in (left_out, null, given)] == [16, None, 16]
    assert [r.requested_max_tokens(True) for r in (left_out, null, given)] == [None, None, 16]
