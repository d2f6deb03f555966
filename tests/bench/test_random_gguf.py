"""benchmarks/random_gguf.py writes a GGUF that vivace (and so the peers' comparison) serves: the
config's shape, the default model's tokenizer; peers.py takes such a file as ``--model``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import gguf
import pytest

from vivace.engine.llm import LLM
from vivace.engine.sampling_params import SamplingParams
from vivace.models.gguf import model_config
from vivace.models.gguf_file import GGUFFile
from vivace.models.loader import default_model_path

REPO = Path(__file__).resolve().parents[2]
F16 = gguf.GGMLQuantizationType.F16
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False)


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"vivace_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # peers.py's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


random_gguf = load("random_gguf")
QWEN3 = {**CONFIG, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32}
GEMMA3 = {**CONFIG, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 32,
          "num_hidden_layers": 6, "sliding_window": 8}


def written(directory: Path, config: dict, name: str) -> Path:
    """The F16 file random_gguf.py writes for ``config`` (given as a config.json)."""
    (directory / "config.json").write_text(json.dumps(config))
    return random_gguf.write(directory / name, str(directory / "config.json"), F16)


def served(path: Path) -> LLM:
    return LLM(str(path), num_kv_blocks=32)


def greedy_tokens(llm: LLM, prompt: str, count: int) -> list[int]:
    params = SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
    return llm.generate(prompt, params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def random_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("random-gguf")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    assert random_gguf.main([str(directory / "tiny.gguf"), "--shape", str(directory / "config.json"),
                             "--type", "Q8_0"]) == 0
    return directory / "tiny.gguf"


def test_the_file_has_the_configs_shape_and_the_default_models_vocabulary(random_file: Path) -> None:
    config = model_config(GGUFFile(random_file))
    default = gguf.GGUFReader(default_model_path())
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 96, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(default.fields["tokenizer.ggml.tokens"].contents())  # not the config's 32000
    tensors = {t.name: t for t in gguf.GGUFReader(random_file).tensors}
    assert tensors["blk.1.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert "output.weight" in tensors  # the config does not tie


def test_vivace_serves_it_with_the_default_tokenizer(random_file: Path) -> None:
    llm, default = served(random_file), LLM("default", num_kv_blocks=32)
    prompt = "The quick brown fox"
    assert llm.tokenizer.encode(prompt) == default.tokenizer.encode(prompt)
    assert len(greedy_tokens(llm, prompt, 8)) == 8


def test_a_qwen3_shape_keeps_its_head_dim_and_q_k_norms(tmp_path: Path) -> None:
    path = written(tmp_path, QWEN3, "qwen3.gguf")
    config = model_config(GGUFFile(path))
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm and config.head_dim == 32
    assert len(greedy_tokens(served(path), "Once", 4)) == 4


def test_a_gemma3_shape_has_its_norms_and_sliding_window(tmp_path: Path) -> None:
    path = written(tmp_path, GEMMA3, "gemma3.gguf")
    config = model_config(GGUFFile(path))
    assert config.architecture == "Gemma3ForCausalLM" and config.qk_norm and config.sliding_window == 8
    assert config.layer_types.count("full_attention") == 1  # every sixth layer
    prompt = "one two three four five six seven eight nine ten eleven twelve"  # past the window
    assert len(greedy_tokens(served(path), prompt, 4)) == 4


def test_a_shape_it_cannot_write_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="phi3"):
        written(tmp_path, {**CONFIG, "model_type": "phi3"}, "phi3.gguf")


def test_peers_takes_a_gguf_path_as_its_model(random_file: Path) -> None:
    peers = load("peers")
    model = peers.PeerModel.from_file(random_file)
    assert model.gguf() == random_file.resolve()
    assert model.title == "# tiny.gguf against llama.cpp"
    config = peers.workload_config("ttft-128", "http://127.0.0.1:1", model)
    assert config.tokenizer == str(random_file.resolve())
