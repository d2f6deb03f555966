"""SmolLM3 (``SmolLM3ForCausalLM``): a Llama whose every 4th layer applies no rotary (NoPE), here
with YaRN on the others, against transformers: its config, logits and greedy tokens (NoPE layers
full or sliding), through the engine, from a GGUF of llama.cpp's ``smollm3`` arch, through the
compiled (AOTInductor) decode step, and its chat template's thinking switches over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from server.harness import RunningServer, assert_engine_idle, serving_own_engine  # tests/ is on sys.path
from vivace import LLM, SamplingParams
from vivace.config import EngineConfig
from vivace.engine.runner import ModelRunner
from vivace.models import ModelConfig, load_model
from vivace.models.config import FULL, NOPE
from vivace.server import ServerSettings

from .gguf_export import write_gguf
from .test_llama import assert_close
from .test_rope_variants import hf_greedy, paged_greedy
from .tiny import _COMMON, PagedRun, hf_logits, prompt, random_model, save_hf_dir, tiny_tokenizer

TEMPLATE = (Path(__file__).parents[1] / "data" / "smollm3_chat_template.jinja").read_text()
# SmolLM3-3B's config.json as published (abridged): 36 layers, every 4th without rotary.
SMOLLM3_3B = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048,
              "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
              "num_key_value_heads": 4, "vocab_size": 128256, "max_position_embeddings": 65536,
              "rope_theta": 5000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06, "no_rope_layer_interval": 4,
              "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(36)], "use_sliding_window": False,
              "sliding_window": None, "tie_word_embeddings": True, "pad_token_id": 128004, "eos_token_id": 128012}
# Four layers (layer 3 NoPE, as llama.cpp's rule has it), YaRN past 128 positions on the others;
# "sliding": the NoPE layer attends to a window of 5 (SmolLM3's use_sliding_window).
VARIANTS = {"yarn": {}, "sliding": dict(use_sliding_window=True, sliding_window=5)}
# Two layers, the second NoPE: what a compile (or Triton's interpreter) takes least long over.
TWO_LAYERS = dict(num_hidden_layers=2, no_rope_layer_interval=2)


def smollm3_config(**overrides: object) -> transformers.SmolLM3Config:
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
    return transformers.SmolLM3Config(**{**_COMMON, "num_hidden_layers": 4, "max_position_embeddings": 256,
                                         "tie_word_embeddings": True, "pad_token_id": None,
                                         "rope_parameters": rope, **overrides})


def save_variant(name: str, out: Path) -> tuple[transformers.PreTrainedModel, Path]:
    """The random model of ``VARIANTS[name]``, saved in ``out`` with SmolLM3's chat template."""
    hf = random_model(smollm3_config(**VARIANTS[name]))
    hf.save_pretrained(out)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return hf, out


@pytest.fixture(scope="module", params=VARIANTS)
def smollm3(request, tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    return save_variant(request.param, tmp_path_factory.mktemp(f"smollm3_{request.param}"))


@pytest.fixture(scope="module")
def smollm3_yarn(tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    return save_variant("yarn", tmp_path_factory.mktemp("smollm3_yarn"))


def test_reads_smollm3_3b_config() -> None:
    config = ModelConfig.from_hf(SMOLLM3_3B)
    assert config.architecture == "SmolLM3ForCausalLM" and config.tie_word_embeddings
    assert config.nope_layers == tuple(range(3, 36, 4)) and config.layer_types == ()
    assert [config.rope_type(i) for i in range(4)] == [FULL, FULL, FULL, NOPE]
    assert (config.rope_theta, config.rope_scaling, config.eos_token_ids) == (5e6, None, (128012,))
    assert ModelConfig.from_hf(transformers.SmolLM3Config(**SMOLLM3_3B)) == config
    sliding = ModelConfig.from_hf({**SMOLLM3_3B, "use_sliding_window": True, "sliding_window": 4096})
    assert [sliding.window(i) for i in range(4)] == [None, None, None, 4096]
    with pytest.raises(ValueError, match="no_rope_layers lists 40 layers, the model has 36"):
        ModelConfig.from_hf({**SMOLLM3_3B, "no_rope_layers": [1] * 40})


def test_logits_and_greedy_tokens_match_transformers(smollm3) -> None:
    hf, path = smollm3
    loaded = load_model(str(path), torch.float32)
    assert loaded.config.nope_layers == (3,) and loaded.model.lm_head is None
    ids = prompt(30, seed=1)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config), ids)
    assert_close(logits, hf_logits(hf, ids))
    assert tokens == hf_greedy(hf, ids)


def test_the_nope_layer_matters(smollm3_yarn) -> None:
    """Guards the test above: rotating layer 3 too moves the logits."""
    hf, path = smollm3_yarn
    loaded = load_model(str(path), torch.float32)
    loaded.model.layers[3].self_attn.rope_type = FULL
    ids = prompt(30, seed=1)
    logits = PagedRun(loaded.model, loaded.config).step({"a": ids})["a"]
    assert (logits - hf_logits(hf, ids)).abs().max() > 1e-2


def test_engine_batched_chunked_and_prefix_cached(smollm3_yarn) -> None:
    hf, path = smollm3_yarn
    prompts = [prompt(length, seed=2 + length) for length in (37, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), num_kv_blocks=48, block_size=4, max_num_batched_tokens=8)
    want = [hf_greedy(hf, ids) for ids in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    again = llm.generate(prompts[0], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want[0]
    llm.check_integrity()


def test_gguf_of_the_smollm3_arch(smollm3_yarn, tmp_path) -> None:
    hf, path = smollm3_yarn
    loaded = load_model(str(write_gguf(hf, tmp_path / "smollm3.gguf")), torch.float32)
    assert loaded.config.nope_layers == (3,)
    assert loaded.config.rope_scaling == load_model(str(path), torch.float32).config.rope_scaling
    ids = prompt(30, seed=3)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config), ids)
    assert_close(logits, hf_logits(hf, ids))
    assert tokens == hf_greedy(hf, ids)


def test_compiled_decode_matches_eager(tmp_path) -> None:
    """The AOTInductor decode graph (plain float weights: a package) binds the NoPE layer's table."""
    loaded = load_model(str(save_hf_dir(random_model(smollm3_config(**TWO_LAYERS)), tmp_path)), torch.float32)
    assert loaded.config.nope_layers == (1,)
    compiled = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32, max_model_len=64,
                           compile_max_batch=4)
    eager = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32, max_model_len=64)
    assert compiled.decoder is not None and compiled.decoder.backend == "aot"
    generator = torch.Generator().manual_seed(0)
    for cache, other in zip(compiled.kv_caches, eager.kv_caches):
        cache.copy_(torch.randn(cache.shape, generator=generator))
        other.copy_(cache)
    for ids, positions, tables in [([11], [9], [[0, 1, 2]]), ([11, 12, 13], [9, 6, 40], [[3, 4, 5], [6, 7], [8] * 11])]:
        with torch.inference_mode():
            ours, theirs = compiled.decode(ids, positions, tables), eager.decode(ids, positions, tables)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


# --- the chat template over HTTP ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm3_yarn) -> Iterator[RunningServer]:
    _, path = smollm3_yarn
    config = EngineConfig(model=str(path), num_kv_blocks=96, max_num_seqs=4)
    with serving_own_engine(config, ServerSettings(served_model_name="smollm3")) as running:
        yield running
        assert_engine_idle(running.engine)


def rendered(server: RunningServer, messages: list[dict], **kwargs: object) -> tuple[str, int]:
    """The prompt the chat template made of ``messages`` (``chat_template_kwargs`` ``kwargs``), and
    its length in tokens."""
    with server.http() as http:
        body = {"messages": messages, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"], len(tokens)


def test_chat_template_thinking_switches(server) -> None:
    hi = [{"role": "user", "content": "hi"}]
    thinking, _ = rendered(server, hi)
    assert "Reasoning Mode: /think\n" in thinking and thinking.endswith("<|im_start|>assistant\n")
    quiet, length = rendered(server, hi, enable_thinking=False)
    assert "Reasoning Mode: /no_think\n" in quiet and quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    system, _ = rendered(server, [{"role": "system", "content": "Be brief. /no_think"}, *hi])
    assert "Reasoning Mode: /no_think\n\nBe brief.\n\n" in system
    chat = server.client().chat.completions.create(
        model="smollm3", messages=hi, max_tokens=3, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3
    assert chat.usage.prompt_tokens == length
