"""GGUF projections kept as their blocks on the CUDA backend, end to end: a tiny random Llama written
as a GGUF file of quantized projections loads with them packed in ``GgufLinear`` (uint8 planar
rows, in Hugging Face order; a tied LM head from the embedding's blocks), and the CUDA runner over
it gives the greedy tokens of the CPU runner on the same file dequantized to float32 (on CPU
under Triton's interpreter where there is no GPU), and so does a Granite's (its multipliers live
outside the projections, which run as stored); a module's chosen GEMV tiling gives its default's
product; the bundled Gemma 3 270M Q4_K_M (Q5_0 where its rows are not a multiple of 256) loads
with every projection packed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from models.gguf_export import write_gguf  # noqa: E402  (tests/ is on sys.path)
from models.tiny import tiny_config, tiny_model  # noqa: E402
from vivace import LLM, SamplingParams  # noqa: E402
from vivace.gpu.gguf_kernels import GPU_TYPES, LAYOUTS, default_gemv_config, planar  # noqa: E402
from vivace.gpu.forward import linear  # noqa: E402
from vivace.gpu.gguf_linear import GgufLinear, randomize_packed  # noqa: E402
from vivace.gpu.runner import CudaRunner  # noqa: E402
from vivace.layers.linear import StackedLinear  # noqa: E402
from vivace.models import load_model  # noqa: E402
from vivace.models.bundled import BUNDLED, bundled_model_path  # noqa: E402
from vivace.models.dummy import random_gguf_blocks  # noqa: E402
from vivace.models.gguf_file import GGUFFile  # noqa: E402

from .conftest import DEVICE, GGUF_TOKENIZERS_OF_5_18  # noqa: E402

T = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parents[2]
# Per GGUF tensor part: every GPU type once. Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 quantize the model's values;
# the K-quants are random blocks (the gguf package cannot quantize to them). "mixed" gives q/k and v
# different types: its fused q/k/v projection runs as two packed runs (a StackedLinear).
TYPES = {
    "uniform": {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
                "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K, "output": T.Q4_1},
    "mixed": {"attn_q": T.Q5_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q5_K,
              "ffn_gate": T.Q5_0, "ffn_up": T.Q5_0, "ffn_down": T.Q8_0, "output": T.Q5_1},
    # Tied embeddings (no output tensor), as llama-quantize's Q4_K_M stores a Llama 3.2 or Qwen3:
    # the LM head packs the embedding's Q6_K blocks.
    "tied": {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q4_K, "attn_output": T.Q4_K,
             "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q4_K, "token_embd": T.Q6_K},
}
PROMPTS = [[5, 90, 31, 242, 77, 12, 5, 90, 31, 242, 77, 12], [8, 100, 200, 7]]
NEW = 3
CONFIG = dict(num_kv_blocks=16, block_size=4, max_model_len=32, device="cpu", quantization="none")


@pytest.fixture(scope="module", params=list(TYPES))
def gguf_model(request, tmp_path_factory):
    """(GGUF path, its part types): 256 wide, K-quant rows of one super-block or more."""
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, intermediate_size=256, initializer_range=0.1,
                         tie_word_embeddings=request.param == "tied")
    hf = transformers.LlamaForCausalLM(config).eval()
    types = TYPES[request.param]
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf", types=types), types


def expected_blocks(module: nn.Module, ggml_type: T) -> tuple[int, int]:
    layout = LAYOUTS[ggml_type]
    return module.out_features, module.in_features // layout.block_cols * layout.block_bytes


def test_projections_stay_packed_and_multiply_as_dequantized(gguf_model) -> None:
    path, types = gguf_model
    packed = load_model(str(path), torch.float32, "auto", device=DEVICE, packed_gguf=True).model
    dense = load_model(str(path), torch.float32, "none", device=DEVICE, packed_gguf=True).model  # all dequantized
    assert not any(isinstance(m, GgufLinear) for m in dense.modules())
    attn, mlp = packed.layers[0].self_attn, packed.layers[0].mlp
    fused_qkv = len({types["attn_q"], types["attn_k"], types["attn_v"]}) == 1
    tied = "output" not in types
    expected = {attn.o_proj: types["attn_output"], mlp.gate_up_proj: types["ffn_gate"],
                mlp.down_proj: types["ffn_down"], packed.lm_head: types["token_embd" if tied else "output"]}
    if fused_qkv:
        expected[attn.qkv_proj] = types["attn_q"]
    else:  # q and k of one type, v of another: two runs, each as stored (no float copy)
        assert isinstance(attn.qkv_proj, StackedLinear)
        q, v = attn.qkv_proj.parts
        expected[q], expected[v] = types["attn_q"], types["attn_v"]
        assert (q.out_features, v.out_features) == (attn.num_heads * attn.head_dim + attn.num_kv_heads * attn.head_dim,
                                                    attn.num_kv_heads * attn.head_dim)
    for module, ggml_type in expected.items():
        assert isinstance(module, GgufLinear) and module.ggml_type == ggml_type
        assert module.blocks.dtype == torch.uint8 and tuple(module.blocks.shape) == expected_blocks(module, ggml_type)
    # Same products as the dequantized model's, q/k rows included (llama.cpp permutes them).
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    dense_attn = dense.layers[0].self_attn
    # The GEMV of Q8_0/Q4 words keeps 2^15 (Q4: 2^11) in float32 sums (gguf_kernels): ~2e-4 of the scale.
    if tied:  # the lookup keeps its float copy
        assert dense.lm_head is None and packed.embed_tokens.weight.dtype == torch.float32
        torch.testing.assert_close(packed.embed_tokens.weight, dense.embed_tokens.weight)
    head = dense.embed_tokens if tied else dense.lm_head
    for ours, theirs in ((attn.qkv_proj, dense_attn.qkv_proj), (packed.lm_head, head)):
        expected = F.linear(x, theirs.weight)
        torch.testing.assert_close(linear(ours, x), expected, rtol=1e-4, atol=5e-4 * expected.abs().max().item())


def test_cpu_only_quantization_is_refused(gguf_model) -> None:
    with pytest.raises(ValueError, match="--quantization int8 runs on CPU only"):
        load_model(str(gguf_model[0]), torch.float32, "int8", packed_gguf=True)


def test_cuda_runner_greedy_tokens_equal_the_dequantized_cpu_runner(gguf_model) -> None:
    path, _ = gguf_model
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **CONFIG).generate(PROMPTS, params)]
    gpu = LLM(str(path), **CONFIG)
    loaded = load_model(str(path), torch.float32, "auto", device=DEVICE, packed_gguf=True)
    assert any(isinstance(m, GgufLinear) for m in loaded.model.modules())
    engine = gpu.engine
    engine.runner = CudaRunner(loaded, len(engine.kv.blocks), engine.kv.block_size, torch.float32,
                               engine.max_model_len, device=DEVICE)
    assert [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params)] == want
    engine.check_integrity()


@pytest.mark.slow
def test_gemma3_270m_q4_k_m_keeps_every_projection_packed() -> None:
    """The bundled Gemma 3 270M Q4_K_M: llama-quantize stored its tensors of 640-wide rows (not a
    multiple of 256) in Q5_0 (q, k, gate, up; v in Q5_0 or Q8_0), the others in Q4_K and Q6_K, its tied
    embedding in Q8_0. Loaded as a GPU loads it, every projection and the LM head keep the file's
    blocks (none becomes a float copy), and a Q5_0 one multiplies as gguf's dequantization."""
    loaded = load_model("gemma-3-270m", torch.bfloat16, "auto", device=DEVICE, packed_gguf=True)
    model = loaded.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    projections = [model.lm_head] + [p for layer in model.layers for p in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    packed = [part for p in projections for part in (p.parts if isinstance(p, StackedLinear) else [p])]
    assert all(isinstance(p, GgufLinear) for p in packed)
    assert {p.ggml_type for p in packed} == {T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K}
    file = GGUFFile(bundled_model_path(BUNDLED["gemma-3-270m"]))
    gate_up = model.layers[0].mlp.gate_up_proj
    assert gate_up.ggml_type == T.Q5_0 and gate_up.in_features == 640
    weight = torch.from_numpy(np.concatenate([file.dequantize(file.tensors[f"blk.0.ffn_{part}.weight"])
                                              for part in ("gate", "up")]))
    for rows in (1, 20):  # the GEMV, the GEMM
        x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(rows)).bfloat16()
        expected = x.float() @ weight.T
        torch.testing.assert_close(gate_up(x.to(DEVICE)).float().cpu(), expected, rtol=1e-2,
                                   atol=1e-2 * expected.abs().max().item())


@GGUF_TOKENIZERS_OF_5_18
def test_granite_q8_0_packed_greedy_tokens_equal_the_dequantized_cpu_runner(tmp_path) -> None:
    path = write_gguf(tiny_model("granite"), tmp_path / "granite.gguf", T.Q8_0)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **CONFIG).generate(PROMPTS, params)]
    gpu = LLM(str(path), **CONFIG)
    loaded = load_model(str(path), torch.float32, "auto", device=DEVICE, packed_gguf=True)
    layer = loaded.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, GgufLinear) and isinstance(layer.mlp.down_proj, GgufLinear)
    engine = gpu.engine
    engine.runner = CudaRunner(loaded, len(engine.kv.blocks), engine.kv.block_size, torch.float32,
                               engine.max_model_len, device=DEVICE)
    assert [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params)] == want
    engine.check_integrity()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graph_replay_with_packed_projections(gguf_model) -> None:
    path, _ = gguf_model
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    config = {**CONFIG, "num_kv_blocks": 64}
    want = [o.outputs[0].token_ids for o in LLM(str(path), **config).generate(PROMPTS * 3, params)]
    graphed = LLM(str(path), **config)
    loaded = load_model(str(path), torch.float32, "auto", device="cuda")
    graphed.engine.runner = CudaRunner(loaded, 64, 4, torch.float32, 32, device="cuda", cuda_graph_max_batch=8)
    assert [o.outputs[0].token_ids for o in graphed.generate(PROMPTS * 3, params)] == want


@pytest.mark.parametrize("ggml_type", GPU_TYPES, ids=lambda t: t.name)
def test_random_blocks_drawn_on_the_device_are_modest_weights(ggml_type) -> None:
    blocks = random_gguf_blocks(ggml_type, 8, 512, DEVICE)
    assert blocks.device.type == DEVICE and blocks.dtype == torch.uint8
    weight = gguf.quants.dequantize(blocks.cpu().numpy(), ggml_type)
    assert weight.shape == (8, 512) and np.isfinite(weight).all() and 0.01 < np.abs(weight).mean() < 1


def test_randomize_packed_q4_k_m_mixes_as_llama_quantize(make_tiny_llama) -> None:
    """The benchmarks' Q4_K_M: Q4_K but for the LM head (tied, so the embedding's own blocks) and,
    in llama-quantize's more-bits layers (of 8: 0, 3, 6, 7), v (apart from q/k) and down, in Q6_K."""
    path = make_tiny_llama(hidden_size=256, intermediate_size=256, num_hidden_layers=8)
    model = load_model(str(path), torch.float32, load_format="dummy", device=DEVICE).model
    randomize_packed(model, "Q4_K_M")
    assert isinstance(model.lm_head, GgufLinear) and model.lm_head.ggml_type == T.Q6_K
    kv_rows = model.config.num_key_value_heads * model.config.head_dim
    for index, layer in enumerate(model.layers):
        more = index in (0, 3, 6, 7)
        qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
        assert down.ggml_type == (T.Q6_K if more else T.Q4_K) and layer.mlp.gate_up_proj.ggml_type == T.Q4_K
        if more:
            assert isinstance(qkv, StackedLinear)
            assert [(part.ggml_type, part.out_features) for part in qkv.parts] == [
                (T.Q4_K, qkv.out_features - kv_rows), (T.Q6_K, kv_rows)]
        else:
            assert qkv.ggml_type == T.Q4_K


def test_blocks_kept_planar_and_gemv_tiling_chosen() -> None:
    """The module keeps the file's bytes in planes (as many); a tiling of its candidates (as
    ``forward.choose_gemv`` sets one) gives the default's product."""
    blocks = random_gguf_blocks(T.Q6_K, 40, 512, DEVICE)
    module = GgufLinear(blocks, T.Q6_K, 512)
    assert torch.equal(module.blocks, planar(blocks, T.Q6_K)) and module.weight_bytes() == blocks.numel()
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = module(x)
    candidates = module.gemv_candidates()
    assert module.gemv_config is None and candidates[0] == default_gemv_config(T.Q6_K)
    module.gemv_config = candidates[-1]
    torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-5)


def test_randomize_packed_packs_every_projection(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir), torch.float32, load_format="dummy", device=DEVICE)
    model = loaded.model
    randomize_packed(model, T.Q4_0)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    packed = [m for m in model.modules() if isinstance(m, GgufLinear)]
    assert len(packed) == 4 * model.config.num_hidden_layers + 1  # tied embeddings: the LM head packed too
    assert model.lm_head in packed and model.embed_tokens.weight.dtype == torch.float32
    assert all(m.ggml_type == T.Q4_0 and m.blocks.device.type == DEVICE for m in packed)
    assert len({tuple(m.blocks[0, :8].tolist()) for m in packed}) == len(packed)  # each drawn anew
    # benchmarks/gpu.py's floor counts the packed bytes, not the embedding (one row a token).
    spec = importlib.util.spec_from_file_location("vivace_gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) - model.embed_tokens.weight.nbytes
    assert benchmark.bytes_read_per_step(loaded, 1, 0) == (dense + sum(m.blocks.numel() for m in packed), 0)
