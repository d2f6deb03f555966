"""load_model(..., quantization=): every projection quantized, logits near the float model's,
and GGUF Q8_0/Q4_1 tensors taken code for code (q/k rows un-permuted, q/k/v and gate/up fused)."""

from __future__ import annotations

import gguf
import transformers
import pytest
import torch
from torch import nn

from vivace.kernels import quant_linear_kernel
from vivace.layers.linear import QuantizedLinear, StackedLinear
from vivace.models import LoadedModel, load_model
from vivace.models.quantize import native_quantization, quantize_model

from .gguf_export import write_gguf
from .tiny import PagedRun, prompt

# Relative L2 error of the logits allowed against the float model. Random Gaussian weights are
# hard on int4 (~8% error per weight, compounded over layers); a wiring mistake gives ~100%.
BOUNDS = {"int8": 0.03, "int4": 0.3}


def logits(path: str, quantization: str) -> tuple[torch.Tensor, nn.Module]:
    loaded = load_model(path, torch.float32, quantization)
    return PagedRun(loaded.model, loaded.config).step({"a": prompt(19, seed=8)})["a"], loaded.model


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama_bias", "qwen2"])
def test_quantized_logits_track_float(tiny, kind: str, mode: str) -> None:
    path = str(tiny(kind).path)
    expected, _ = logits(path, "none")
    actual, model = logits(path, mode)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == 8
    assert ((actual - expected).norm() / expected.norm()).item() < BOUNDS[mode]


@pytest.mark.parametrize(("ggml_type", "mode"), [(gguf.GGMLQuantizationType.Q8_0, "int8"),
                                                 (gguf.GGMLQuantizationType.Q4_1, "int4")], ids=["q8_0", "q4_1"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_codes_are_taken_as_stored(tiny, tmp_path, kind: str, ggml_type, mode: str) -> None:
    path = str(write_gguf(tiny(kind).hf, tmp_path / "model.gguf", ggml_type))
    reference = load_model(path, torch.float32).model  # the file's values, dequantized
    quantized = load_model(path, torch.float32, mode).model
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear) and name != "lm_head":
            torch.testing.assert_close(module.dequantize(), reference.get_submodule(name).weight, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["int8", "int4", "gguf"])
def test_an_untied_logits_layer_is_its_own_whatever_the_embeddings_format(tiny, tmp_path, mode: str) -> None:
    """The embeddings in Q8_0, the output in float (llama-quantize --leave-output-tensor): the logits
    layer is the output's, quantized to int8, never the embeddings' codes taken in its place."""
    model = tiny("llama")  # untied
    path = write_gguf(model.hf, tmp_path / "model.gguf", types={"token_embd": gguf.GGMLQuantizationType.Q8_0})
    output = load_model(str(path), torch.float32).model.lm_head.weight
    logits_layer = load_model(str(path), torch.float32, mode).model.lm_head
    step = output.abs().amax() / 127  # int8's rounding at most half a step of the largest scale
    assert (logits_layer.dequantize() - output).abs().max() <= step / 2


def test_rejects_unknown_mode(tiny) -> None:
    model = load_model(str(tiny("llama").path), torch.float32).model
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(model, "int3")


@pytest.mark.parametrize(("ggml_type", "bits"), [(gguf.GGMLQuantizationType.Q8_0, {8}),
                                                 (gguf.GGMLQuantizationType.Q4_1, {4}),
                                                 (gguf.GGMLQuantizationType.F16, set())], ids=["q8_0", "q4_1", "f16"])
def test_auto_runs_a_gguf_in_its_own_format(tiny, tmp_path, ggml_type, bits: set[int]) -> None:
    path = write_gguf(tiny("llama").hf, tmp_path / "model.gguf", ggml_type)
    assert native_quantization(path) == ("none" if ggml_type == gguf.GGMLQuantizationType.F16 else "gguf")
    model = load_model(str(path), torch.float32, "auto").model
    bits_here = {m.bits for m in model.layers.modules() if isinstance(m, QuantizedLinear)}
    # Without a native kernel the torch fallback would be slower than float: auto keeps float.
    assert bits_here == (bits if quant_linear_kernel() is not None else set())


def test_auto_keeps_a_float_checkpoint_float(tiny) -> None:
    model = load_model(str(tiny("llama").path), torch.float32, "auto").model
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def k_quant_model() -> transformers.LlamaForCausalLM:
    """A random Llama whose widths hold whole K-quant super-blocks (256 columns)."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def logits_error(expected: LoadedModel, actual: LoadedModel) -> float:
    """Relative L2 distance between two loaded models' logits over one prompt."""
    ids = prompt(12, seed=9)
    reference = PagedRun(expected.model, expected.config).step({"a": ids})["a"]
    logits = PagedRun(actual.model, actual.config).step({"a": ids})["a"]
    return ((logits - reference).norm() / reference.norm()).item()


def test_a_k_quant_mix_runs_in_its_own_formats(tmp_path, caplog) -> None:
    """A Q4_K_M-like file (Q4_K, Q5_K, Q6_K, Q5_0, Q8_0 tensors): "gguf" (what "auto" picks where
    the native kernels run) takes each in its own form (q/k/v of three formats as three runs, none
    widened; the Q6_K logits layer as it is), and the logits stay those of the file's dequantized
    values; so with IQ4_NL/IQ4_XS tensors (4-bit codes into their table, q and k of the two types
    stacked as one run, v apart) and an IQ3_S one (no native form: Q8_0 of its values, with a
    warning)."""
    hf = k_quant_model()
    q = gguf.GGMLQuantizationType
    types = {"attn_q": q.Q4_K, "attn_k": q.Q5_0, "attn_v": q.Q6_K, "attn_output": q.Q5_K, "ffn_gate": q.Q4_K,
             "ffn_up": q.Q4_K, "ffn_down": q.Q6_K, "token_embd": q.Q8_0, "output": q.Q6_K}
    path = write_gguf(hf, tmp_path / "kquant.gguf", q.F32, types)
    reference = load_model(str(path), torch.float32, "none")
    with caplog.at_level("WARNING"):
        loaded = load_model(str(path), torch.float32, "gguf")
    assert not caplog.records
    layer = loaded.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, StackedLinear)
    assert [(part.bits, part.sub_group, part.out_features) for part in qkv.parts] == [(4, 32, 256), (5, 0, 128),
                                                                                      (6, 16, 128)]
    torch.testing.assert_close(qkv.dequantize(), reference.model.layers[0].self_attn.qkv_proj.weight,
                               rtol=0, atol=1e-6)  # the file's numbers: none requantized
    assert (layer.mlp.gate_up_proj.bits, layer.self_attn.o_proj.bits, layer.mlp.down_proj.bits) == (4, 5, 6)
    assert (layer.mlp.gate_up_proj.sub_group, layer.self_attn.o_proj.sub_group, layer.mlp.down_proj.sub_group) == \
        (32, 32, 16)
    assert (loaded.model.lm_head.bits, loaded.model.lm_head.sub_group) == (6, 16)
    # The native kernels also round activations to int8 per group of 32 (~0.5% relative each) at
    # all 8 projections and the logits of this random model: 2.7% measured, 0.7% on the fallback.
    tolerance = 4e-2 if quant_linear_kernel() is not None else 2e-2
    assert logits_error(reference, loaded) < tolerance

    # A type without a native form (IQ3_S) runs as Q8_0 of its dequantized values, with a warning;
    # IQ4_NL and IQ4_XS run natively as 4-bit codes into their table, without one: 4.5 bits a
    # weight (8.5 as the 8-bit codes of their values they ran as before).
    mixed = {**types, "ffn_down": q.IQ3_S, "attn_output": q.IQ4_XS, "ffn_gate": q.IQ4_NL, "ffn_up": q.IQ4_NL,
             "attn_q": q.IQ4_NL, "attn_k": q.IQ4_XS}
    path = write_gguf(hf, tmp_path / "iq.gguf", q.F32, mixed)
    reference = load_model(str(path), torch.float32, "none")
    with caplog.at_level("WARNING"):
        loaded = load_model(str(path), torch.float32, "gguf")
    assert "IQ3_S (2 tensors)" in caplog.text and "as Q8_0" in caplog.text and "IQ4_XS (" not in caplog.text \
        and "IQ4_NL (" not in caplog.text
    layer, dense = loaded.model.layers[0], reference.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert [(part.bits, part.codebook is not None, part.out_features) for part in qkv.parts] == [(4, True, 384),
                                                                                                (6, False, 128)]
    assert (layer.mlp.down_proj.bits, layer.mlp.down_proj.codebook) == (8, None)
    for iq4 in (qkv.parts[0], layer.self_attn.o_proj, layer.mlp.gate_up_proj):  # codes, scales, a 16-byte table
        assert 8 * (iq4.weight_bytes() - 16) == 4.5 * iq4.out_features * iq4.in_features
    # The file's values: IQ4_XS's per-32 scales rounded to float16 (gguf_blocks), the others exact.
    for actual, float_layer in ((qkv, dense.self_attn.qkv_proj), (layer.self_attn.o_proj, dense.self_attn.o_proj),
                                (layer.mlp.gate_up_proj, dense.mlp.gate_up_proj)):
        torch.testing.assert_close(actual.dequantize(), float_layer.weight, rtol=2**-11, atol=1e-6)
    # Q8_0's rounding of the dequantized IQ3_S values (steps of amax / 127 per 32): 0.5% here.
    down, want = layer.mlp.down_proj.dequantize(), dense.mlp.down_proj.weight
    assert 0 < ((down - want).norm() / want.norm()).item() < 1e-2
    assert logits_error(reference, loaded) < tolerance


def test_a_low_bit_k_quant_mix_runs_natively(tmp_path, caplog) -> None:
    """A Q2_K/Q3_K_M-like file (Q2_K, Q3_K, Q4_K tensors): "gguf" takes the Q2_K and Q3_K ones
    as 2- and 3-bit codes with 16-column sub-blocks (Q2_K's with mins, Q3_K's with zero point 4),
    none quantized again as Q8_0, each the file's numbers, and the logits track the dequantized
    model's."""
    hf = k_quant_model()
    q = gguf.GGMLQuantizationType
    types = {"attn_q": q.Q2_K, "attn_k": q.Q2_K, "attn_v": q.Q3_K, "attn_output": q.Q3_K, "ffn_gate": q.Q2_K,
             "ffn_up": q.Q3_K, "ffn_down": q.Q4_K, "token_embd": q.Q2_K, "output": q.Q6_K}
    path = write_gguf(hf, tmp_path / "q2k.gguf", q.F32, types)
    assert native_quantization(path) == "gguf"
    reference = load_model(str(path), torch.float32, "none")
    with caplog.at_level("WARNING"):
        loaded = load_model(str(path), torch.float32, "gguf")
    assert not caplog.records
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    layer, expected = loaded.model.layers[1], reference.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    forms = [(part.bits, part.sub_group, part.zero_point, part.mins is not None, part.out_features)
             for part in (*qkv.parts, layer.self_attn.o_proj, *gate_up.parts)]
    assert forms == [(2, 16, 0, True, 384), (3, 16, 4, False, 128), (3, 16, 4, False, 256), (2, 16, 0, True, 512),
                     (3, 16, 4, False, 512)]
    for actual, float_layer in ((qkv, expected.self_attn.qkv_proj), (gate_up, expected.mlp.gate_up_proj),
                                (layer.self_attn.o_proj, expected.self_attn.o_proj)):
        torch.testing.assert_close(actual.dequantize(), float_layer.weight, rtol=0, atol=0)
    # As above, the native kernels' int8 activations at every projection: 2.1% measured, 0 on the
    # fallback (the file's weights exactly); a wiring mistake gives ~100%.
    assert logits_error(reference, loaded) < (4e-2 if quant_linear_kernel() is not None else 2e-2)
