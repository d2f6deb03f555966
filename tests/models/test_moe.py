"""Mixtures of experts (vivace.models.moe): tiny random Qwen3-MoE (a dense middle layer) and
Mixtral (8 experts, top-2) against transformers in float32, from safetensors in both expert
layouts and from GGUF files (float, Q8_0, Q4_K/Q6_K); through the engine with batching, chunked prefill,
a prefix-cache hit and n-gram speculation; and the refusals (CUDA backend, unsupported variants)."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from vivace import LLM, SamplingParams
from vivace.layers.linear import QuantizedLinear
from vivace.models import ModelConfig, load_model
from vivace.models.gguf import model_config
from vivace.models.llama import MLP
from vivace.models.moe import SparseMoeBlock
from vivace.models.quantize import experts_taken_as_stored

from .gguf_export import write_gguf
from .test_llama import assert_close
from .test_rope_variants import hf_greedy, metadata_only_gguf, paged_greedy
from .tiny import MOE_KINDS, PagedRun, hf_logits, prompt, save_hf_dir, tiny_model

NEW = 16
Q8_0, Q4_K = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K
# Q8_0 through the native kernel, which quantizes activations to int8: the relative L2 error of a
# position's logits against the same weights in float32. A routing decision that the activation
# rounding flips shows as an outlier position (and its successors), hence the median; a wrong
# expert or row order gives ~100%.
NATIVE_Q8_MEDIAN_ERROR = 0.03
# The same for Q4_K/Q6_K experts of random codes, whose logits also carry the int8 logits layer
# quantized from the F16 one (measured ~0.02).
NATIVE_K_MEDIAN_ERROR = 0.05


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def moe(request, tiny):
    return tiny(request.param)


def relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return (actual - expected).norm(dim=-1) / expected.norm(dim=-1)


def test_logits_and_greedy_tokens_match_transformers(moe) -> None:
    loaded = load_model(str(moe.path), torch.float32)
    ids = prompt(21, seed=1)
    logits, tokens = paged_greedy(PagedRun(loaded.model, loaded.config), ids, NEW)
    assert_close(logits, hf_logits(moe.hf, ids))
    assert tokens == hf_greedy(moe.hf, ids, NEW)


def test_qwen3_moe_sparse_step_and_unnormalized_weights(tmp_path) -> None:
    """``decoder_sparse_step`` 2 makes layers 0 and 2 dense; without ``norm_topk_prob`` the chosen
    experts' softmax weights are used as they are."""
    hf = tiny_model("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)
    loaded = load_model(str(save_hf_dir(hf, tmp_path)), torch.float32)
    assert loaded.config.moe.dense_layers == (0, 2) and not loaded.config.moe.norm_topk_prob
    assert [type(layer.mlp) for layer in loaded.model.layers] == [MLP, SparseMoeBlock, MLP]
    ids = prompt(15, seed=2)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(hf, ids))


def test_config_of_the_layers(tiny) -> None:
    qwen = load_model(str(tiny("qwen3_moe").path), torch.float32).model
    assert [type(layer.mlp) for layer in qwen.layers] == [SparseMoeBlock, MLP, SparseMoeBlock]
    assert qwen.layers[1].mlp.down_proj.in_features == 96  # the dense layer: intermediate_size
    block = qwen.layers[0].mlp
    assert len(block.experts) == 8 and block.top_k == 2 and block.experts[0].down_proj.in_features == 32
    assert qwen.config.qk_norm and not qwen.compilable


def test_stacked_expert_checkpoint_loads_alike(moe, tmp_path) -> None:
    """transformers 5 writes its in-memory layout (one [experts, out, in] tensor a projection)
    with ``save_original_format=False``; ``save_pretrained``'s default writes one tensor an expert."""
    path = save_hf_dir(moe.hf, tmp_path, save_original_format=False)
    loaded = load_model(str(path), torch.float32)
    ids = prompt(12, seed=3)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(moe.hf, ids))


def test_engine_batches_chunks_caches_prefixes_and_speculates(moe) -> None:
    """Three prompts batched with 8-token steps (prompts prefill in chunks beside the others'
    decodes), n-gram speculation (the repetitive prompt gets drafts verified), then one prompt
    again: a prefix-cache hit. ``compile`` is asked and declined: MoE steps run eagerly."""
    base = prompt(6, seed=4)
    prompts = [base * 4, prompt(7, seed=5), prompt(13, seed=6)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm = LLM(str(moe.path), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, compile=True,
              speculative="ngram", num_speculative_tokens=3)
    assert llm.engine.runner.decoder is None and llm.engine.runner.compiled_rows == 0
    want = [hf_greedy(moe.hf, ids, NEW) for ids in prompts]
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == want
    assert llm.engine.spec_stats.num_proposed > 0
    again = llm.generate(prompts[2], params)[0]
    assert again.num_cached_tokens >= 12 and again.outputs[0].token_ids == want[2]
    llm.check_integrity()


# --- GGUF ------------------------------------------------------------------------------------------

def test_float_gguf_matches_transformers(moe, tmp_path) -> None:
    path = write_gguf(moe.hf, tmp_path / "moe.gguf")
    loaded = load_model(str(path), torch.float32)
    assert loaded.config.moe == load_model(str(moe.path), torch.float32).config.moe
    ids = prompt(17, seed=9)
    assert_close(PagedRun(loaded.model, loaded.config).step({"a": ids})["a"], hf_logits(moe.hf, ids))


def dequantized_reference(hf: nn.Module, ggml_type: gguf.GGMLQuantizationType) -> nn.Module:
    """``hf`` with every matrix the GGUF export quantizes (all but the router) replaced by its
    values quantized to ``ggml_type`` and dequantized (``gguf.quants``)."""
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                codes = gguf.quants.quantize(param.numpy(), ggml_type)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(codes, ggml_type)))
    return reference


def test_q8_0_gguf_experts_run_as_stored(moe, tmp_path) -> None:
    """Each expert is its own slice of the stacked Q8_0 tensor, taken code for code (never decoded
    to float: no meta tensor is left of the undecoded ones); dequantized to float, or run by the
    torch fallback, the logits are transformers' on the dequantized weights."""
    path = str(write_gguf(moe.hf, tmp_path / "moe-q8.gguf", Q8_0))
    reference = dequantized_reference(moe.hf, Q8_0)
    ids = prompt(17, seed=10)
    expected = hf_logits(reference, ids)
    as_float = load_model(path, torch.float32, "none")
    assert_close(PagedRun(as_float.model, as_float.config).step({"a": ids})["a"], expected)
    quantized = load_model(path, torch.float32, "gguf")
    assert not any(t.is_meta for t in [*quantized.model.parameters(), *quantized.model.buffers()])
    block = quantized.model.layers[0].mlp
    assert type(block.gate) is nn.Linear  # the router stays float
    for e, expert in enumerate(block.experts):
        for name in ("gate_up_proj", "down_proj"):
            projection = getattr(expert, name)
            assert isinstance(projection, QuantizedLinear) and projection.bits == 8
            want = getattr(as_float.model.layers[0].mlp.experts[e], name).weight
            torch.testing.assert_close(projection.dequantize(), want, rtol=0, atol=0)
    native = PagedRun(quantized.model, quantized.config).step({"a": ids})["a"]
    assert relative_errors(native, expected).median() < NATIVE_Q8_MEDIAN_ERROR
    for module in quantized.model.modules():
        if isinstance(module, QuantizedLinear):
            module.backend = "torch"
    assert_close(PagedRun(quantized.model, quantized.config).step({"a": ids})["a"], expected)


def test_q4_k_m_experts_run_as_stored(tmp_path) -> None:
    """Experts as llama.cpp's Q4_K_M stores them (gate/up Q4_K, down Q6_K; random codes, 256-wide
    super-blocks): each expert's slice taken code for code, run by the native kernels."""
    hf = tiny_model("qwen3_moe", hidden_size=256, intermediate_size=256, moe_intermediate_size=256)
    types = {"ffn_gate_exps": Q4_K, "ffn_up_exps": Q4_K, "ffn_down_exps": gguf.GGMLQuantizationType.Q6_K}
    path = str(write_gguf(hf, tmp_path / "moe-q4_k_m.gguf", gguf.GGMLQuantizationType.F16, types))
    exps = {f"blk.{layer}.ffn_{part}_exps.weight" for layer in (0, 2) for part in ("gate", "up", "down")}
    assert experts_taken_as_stored(path, "gguf") == exps and not experts_taken_as_stored(path, "int8")
    as_float, quantized = load_model(path, torch.float32, "none"), load_model(path, torch.float32, "gguf")
    for layer in (0, 2):
        for e, expert in enumerate(quantized.model.layers[layer].mlp.experts):
            want = as_float.model.layers[layer].mlp.experts[e]
            assert (expert.gate_up_proj.bits, expert.down_proj.bits) == (4, 6)
            torch.testing.assert_close(expert.gate_up_proj.dequantize(), want.gate_up_proj.weight, rtol=0, atol=0)
            torch.testing.assert_close(expert.down_proj.dequantize(), want.down_proj.weight, rtol=0, atol=0)
    ids = prompt(9, seed=12)
    expected = PagedRun(as_float.model, as_float.config).step({"a": ids})["a"]
    native = PagedRun(quantized.model, quantized.config).step({"a": ids})["a"]
    assert relative_errors(native, expected).median() < NATIVE_K_MEDIAN_ERROR


def test_int8_quantizes_every_expert(tiny) -> None:
    path = str(tiny("mixtral").path)
    ids = prompt(15, seed=11)
    float_model = load_model(path, torch.float32)
    expected = PagedRun(float_model.model, float_model.config).step({"a": ids})["a"]
    loaded = load_model(path, torch.float32, "int8")
    linears = {name for name, m in loaded.model.named_modules() if isinstance(m, nn.Linear)}
    assert linears == {"layers.0.mlp.gate", "layers.1.mlp.gate"}  # the routers only
    assert isinstance(loaded.model.layers[1].mlp.experts[7].down_proj, QuantizedLinear)
    actual = PagedRun(loaded.model, loaded.config).step({"a": ids})["a"]
    assert relative_errors(actual, expected).median() < NATIVE_Q8_MEDIAN_ERROR


# --- refusals --------------------------------------------------------------------------------------

def test_cuda_backend_refuses_experts(tiny) -> None:
    path = str(tiny("qwen3_moe").path)
    with pytest.raises(ValueError, match=r"--device cuda does not run mixture-of-experts models "
                                         r"\(Qwen3MoeForCausalLM\); serve it with --device cpu"):
        load_model(path, torch.float32, device="cuda")
    pytest.importorskip("triton")
    from vivace.gpu.forward import check_supported

    with pytest.raises(ValueError, match=r"--device cuda .* not MixtralForCausalLM \(a mixture of experts"):
        check_supported(load_model(str(tiny("mixtral").path), torch.float32).model)


def test_unsupported_variants(tmp_path) -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen2MoeForCausalLM'"):
        ModelConfig.from_hf({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"})
    experts = {"{arch}.expert_count": 8, "{arch}.expert_used_count": 2}
    gate = {"blk.0.ffn_gate_inp.weight": np.zeros((8, 64), np.float32)}
    assert model_config(metadata_only_gguf(tmp_path / "a.gguf", "llama", experts, gate)).architecture == \
        "MixtralForCausalLM"
    with pytest.raises(ValueError, match="expert_gating_func"):
        model_config(metadata_only_gguf(tmp_path / "b.gguf", "qwen3moe",
                                        {**experts, "{arch}.expert_gating_func": 2}, gate))
    with pytest.raises(ValueError, match=r"shared experts \(ffn_up_shexp\)"):
        model_config(metadata_only_gguf(tmp_path / "c.gguf", "llama", experts,
                                        {**gate, "blk.0.ffn_up_shexp.weight": np.zeros((16, 64), np.float32)}))
    with pytest.raises(ValueError, match="'qwen3moe.expert_count'"):
        model_config(metadata_only_gguf(tmp_path / "d.gguf", "qwen3moe", {}, {}))
