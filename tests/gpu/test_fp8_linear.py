"""FP8 projections on the CUDA backend, end to end: a tiny Llama quantized at load (``--quantization
fp8``) computes the logits of its dequantized weights, close to the float model's; a layer's GEMV
tiling (``gemv_config``, from ``gemv_candidates``) reaches its forward; FP8 checkpoints in
the ``compressed-tensors`` and ``fbgemm_fp8`` layouts load as stored, and the CUDA runner over them
gives the greedy tokens of the CPU runner on the same checkpoint dequantized; random FP8 weights for
``--load-format dummy`` (on CPU under Triton's interpreter where there is no GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from models.tiny import save_hf_dir, tiny_model  # noqa: E402  (tests/ is on sys.path)
from vivace import LLM, SamplingParams  # noqa: E402
from vivace.config import EngineConfig, check_quantization  # noqa: E402
from vivace.gpu.fp8_kernels import FP8, GEMV_DEFAULT, quantize_weight  # noqa: E402
from vivace.gpu.fp8_linear import Fp8Linear, float_layers  # noqa: E402
from vivace.gpu.forward import GpuBatch, forward  # noqa: E402
from vivace.gpu.kernels import GemvConfig  # noqa: E402
from vivace.gpu.runner import CudaRunner  # noqa: E402
from vivace.models import load_model  # noqa: E402
from vivace.models.fp8 import read_fp8  # noqa: E402

from .conftest import DEVICE  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 90, 31, 242, 77, 12, 5, 90, 31, 242, 77, 12], [8, 100, 200, 7]]
NEW = 4
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# How each layout stores a projection's scale, and the activation scales it adds (dropped on load).
LAYOUTS = {
    "compressed-tensors-channel": dict(scale=lambda s: s[:, None].bfloat16(), extra={}),
    "compressed-tensors-tensor": dict(scale=lambda s: s.amax().reshape(1), extra={"input_scale": torch.tensor([0.02])}),
    "fbgemm_fp8": dict(scale=lambda s: s[:, None], extra={"input_scale_ub": torch.tensor([1200.0])}),
}


def projections(model: nn.Module) -> list[nn.Module]:
    return [getattr(part, name) for layer in model.layers for part in (layer.self_attn, layer.mlp)
            for name in PROJECTIONS if hasattr(part, name)]


@torch.inference_mode()
def prompt_logits(model: nn.Module, prompt: list[int]) -> torch.Tensor:
    """float32 logits of one prefill of ``prompt`` through the CUDA forward."""
    n, block_size = len(prompt), 4
    caches = [torch.zeros(2, 5, block_size, model.config.num_key_value_heads, model.config.head_dim, device=DEVICE)
              for _ in range(model.config.num_hidden_layers)]
    ids = torch.tensor(prompt, device=DEVICE)
    positions = torch.arange(n, device=DEVICE)
    batch = GpuBatch(ids, positions, positions.clone(), torch.arange(5, dtype=torch.int32, device=DEVICE)[None],
                     torch.tensor([n], dtype=torch.int32, device=DEVICE),
                     torch.tensor([0, n], dtype=torch.int32, device=DEVICE), n)
    return model.compute_logits(forward(model, batch, caches)).cpu()


def test_quantized_at_load_computes_its_dequantized_weights(tiny_model_dir) -> None:
    dense = load_model(str(tiny_model_dir), torch.float32, device=DEVICE)
    fp8 = load_model(str(tiny_model_dir), torch.float32, "fp8", device=DEVICE)
    layers = projections(fp8.model)
    assert len(layers) == 4 * fp8.config.num_hidden_layers and all(isinstance(m, Fp8Linear) for m in layers)
    assert all(m.weight.dtype == FP8 and m.weight.device.type == DEVICE for m in layers)
    assert fp8.model.lm_head is None  # tied: the float embedding stays the LM head
    fp8_bytes = sum(m.weight.numel() + 4 * m.out_features for m in layers)
    assert dense.weight_bytes - fp8.weight_bytes == sum(4 * m.weight.numel() for m in layers) - fp8_bytes
    with torch.inference_mode():
        float_logits = [prompt_logits(dense.model, p) for p in PROMPTS]  # 12 rows: the GEMM; 4: the GEMV
        for ours, theirs in zip(projections(fp8.model), projections(dense.model)):
            theirs.weight.copy_(ours.dequantize())
    for prompt, float_logit in zip(PROMPTS, float_logits):
        logits = prompt_logits(fp8.model, prompt)
        torch.testing.assert_close(logits, prompt_logits(dense.model, prompt), rtol=0, atol=1e-4)
        error = (logits - float_logit).norm(dim=1) / float_logit.norm(dim=1)
        assert 0 < error.max() < 0.1  # quantized, by e4m3 rounding (2-3% a weight) through 2 layers


def test_gemv_config_tiles_the_forward_of_up_to_8_rows() -> None:
    layer = Fp8Linear.from_float(torch.randn(40, 96, generator=torch.Generator().manual_seed(0)).to(DEVICE))
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # 6 rows
    want = x @ layer.dequantize().T
    candidates = layer.gemv_candidates()
    assert layer.gemv_config is None and candidates[0] == GEMV_DEFAULT and len(candidates) <= 12
    for config in (GEMV_DEFAULT, GemvConfig(4, 128, 2, False, 1)):
        layer.gemv_config = config
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    layer.gemv_config = GemvConfig(block_n=3, block_k=256)  # not a tiling: the forward passes it on
    with pytest.raises(ValueError, match="powers of 2"):
        layer(x)


def write_fp8_checkpoint(hf: nn.Module, out: Path, layout: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``hf`` saved with its decoder projections in FP8, in ``layout``; returns each projection's
    ``(codes, scale per row)`` by Hugging Face name. The LM head stays float, as these layouts keep it."""
    save_hf_dir(hf, out)
    tensors, stored = {}, {}
    for name, tensor in load_file(out / "model.safetensors").items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            tensors[name] = tensor
            continue
        codes, scale = quantize_weight(tensor)
        stored_scale = LAYOUTS[layout]["scale"](scale)
        tensors[name], tensors[name + "_scale"] = codes, stored_scale
        stored[name] = codes, stored_scale.float().reshape(-1).expand(len(codes))
        for suffix, value in LAYOUTS[layout]["extra"].items():
            tensors[name.removesuffix("weight") + suffix] = value.clone()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    method = "fbgemm_fp8" if layout == "fbgemm_fp8" else "compressed-tensors"
    config["quantization_config"] = {"quant_method": method}  # what vivace reads is the tensors themselves
    (out / "config.json").write_text(json.dumps(config))
    return stored


@pytest.fixture(scope="module", params=list(LAYOUTS))
def fp8_checkpoint(request, tmp_path_factory):
    """(directory, stored codes and scales): a tiny Llama with q/k/v biases and an untied LM head."""
    hf = tiny_model("llama_bias")
    out = tmp_path_factory.mktemp(request.param)
    return out, write_fp8_checkpoint(hf, out, request.param)


def test_fp8_checkpoint_loads_as_stored_or_dequantized(fp8_checkpoint) -> None:
    path, stored = fp8_checkpoint
    kept = load_model(str(path), torch.float32, "fp8", device=DEVICE).model
    dense = load_model(str(path), torch.float32, "auto").model  # CPU: dequantized
    assert not any(isinstance(m, Fp8Linear) for m in dense.modules())
    assert type(kept.lm_head) is nn.Linear
    for index, layer in enumerate(kept.layers):
        prefix = f"model.layers.{index}"
        parts = {"qkv_proj": [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv"],
                 "o_proj": [f"{prefix}.self_attn.o_proj.weight"],
                 "gate_up_proj": [f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up")],
                 "down_proj": [f"{prefix}.mlp.down_proj.weight"]}
        for name, hf_names in parts.items():
            parent = layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp
            module = getattr(parent, name)
            codes = torch.cat([stored[n][0] for n in hf_names])
            scale = torch.cat([stored[n][1] for n in hf_names])
            assert isinstance(module, Fp8Linear)
            assert torch.equal(module.weight.cpu().view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(module.scale.cpu(), scale)
            float_layer = getattr(dense.layers[index].self_attn if name in ("qkv_proj", "o_proj")
                                  else dense.layers[index].mlp, name)
            assert torch.equal(float_layer.weight, codes.float() * scale[:, None])
    assert kept.layers[0].self_attn.qkv_proj.bias is not None


def test_cuda_runner_on_an_fp8_checkpoint_equals_the_dequantized_cpu_runner(fp8_checkpoint) -> None:
    path, _ = fp8_checkpoint
    config = dict(num_kv_blocks=16, block_size=4, max_model_len=32, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **config).generate(PROMPTS, params)]
    gpu = LLM(str(path), **config)
    loaded = load_model(str(path), torch.float32, "fp8", device=DEVICE)
    engine = gpu.engine
    engine.runner = CudaRunner(loaded, len(engine.kv.blocks), engine.kv.block_size, torch.float32,
                               engine.max_model_len, device=DEVICE)
    assert [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params)] == want
    engine.check_integrity()


def test_read_fp8_refuses_what_it_cannot_pair() -> None:
    codes = torch.zeros(4, 16, dtype=FP8)
    with pytest.raises(ValueError, match="do not pair up"):
        list(read_fp8([("a.weight", codes)], None))
    with pytest.raises(ValueError, match="do not pair up"):
        list(read_fp8([("a.weight_scale", torch.ones(4, 1))], None))
    with pytest.raises(ValueError, match="one scale per tensor or per output row"):
        list(read_fp8([("a.weight", codes), ("a.weight_scale", torch.ones(2, 1))], None))  # block-wise
    with pytest.raises(ValueError, match="float8_e4m3fn only"):
        list(read_fp8([("a.weight", codes.to(torch.float8_e5m2))], None))
    plain = [("norm.weight", torch.ones(4)), ("a.weight", codes), ("a.input_scale", torch.ones(1)),
             ("a.weight_scale", torch.full((1,), 2.0))]
    stored = {}
    assert [(n, t.device.type) for n, t in read_fp8(plain, stored)] == [("norm.weight", "cpu"), ("a.weight", "meta")]
    assert torch.equal(stored["a.weight"][1], torch.full((4,), 2.0))


def test_the_first_and_last_layers_stay_float_in_deeper_models(tmp_path) -> None:
    """From 8 decoder layers, layers 0 and N - 1 keep float projections (the most sensitive to e4m3);
    the 2-layer models above have every projection in FP8."""
    assert float_layers(2) == float_layers(7) == set() and float_layers(8) == {0, 7} and float_layers(30) == {0, 29}
    path = save_hf_dir(tiny_model("llama", num_hidden_layers=8), tmp_path / "deep")
    loaded = load_model(str(path), torch.float32, "fp8", device=DEVICE)
    for index, layer in enumerate(loaded.model.layers):
        parts = [getattr(part, name) for part in (layer.self_attn, layer.mlp) for name in PROJECTIONS if hasattr(part, name)]
        want = nn.Linear if index in (0, 7) else Fp8Linear
        assert len(parts) == 4 and all(type(m) is want for m in parts), (index, [type(m) for m in parts])
    dummy = load_model(str(path), torch.float32, "fp8", load_format="dummy", device=DEVICE)
    assert [type(layer.mlp.down_proj) for layer in dummy.model.layers] == [nn.Linear] + [Fp8Linear] * 6 + [nn.Linear]


def test_dummy_weights_in_fp8(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir), torch.float32, "fp8", load_format="dummy", device=DEVICE)
    layers = projections(loaded.model)
    assert all(isinstance(m, Fp8Linear) and m.weight.device.type == DEVICE for m in layers)
    assert len({tuple(m.weight[0, :8].float().tolist()) for m in layers}) == len(layers)  # each drawn anew
    fp8_bytes = sum(m.weight_bytes() for m in layers)
    dense = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert loaded.weight_bytes == dense + fp8_bytes
    # benchmarks/gpu.py's floor counts the FP8 bytes (and the tied embedding, the LM head's weight).
    spec = importlib.util.spec_from_file_location("vivace_gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    assert benchmark.bytes_read_per_step(loaded, 1, 0) == (dense + fp8_bytes, 0)


def test_fp8_is_refused_where_the_device_cannot_run_it(tiny_model_dir) -> None:
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="--quantization fp8 runs on CUDA GPUs of compute capability 8.9"):
        check_quantization("fp8", "cpu")
    with pytest.raises(ValueError, match="--quantization int8 runs on CPU only"):
        check_quantization("int8", "cuda")
    with pytest.raises(ValueError, match="compute capability 8.9"):
        LLM(str(tiny_model_dir), device="cpu", quantization="fp8", num_kv_blocks=8)


def test_choose_gemv_keeps_the_fastest_candidate_that_runs(tiny_model_dir, monkeypatch) -> None:
    """``forward.choose_gemv``'s choice for FP8 modules, its timer replaced (CUDA events need a
    GPU) by one that runs the products and reads the time a configuration is given: the fastest
    candidate that compiles and launches is kept, at one row of x and at 8; one that raises is
    skipped, not fatal; where none beats the default by 3%, the default stays."""
    from vivace.gpu import forward as gpu_forward

    model = load_model(str(tiny_model_dir), torch.float32, "fp8", device=DEVICE).model
    candidates = projections(model)[0].gemv_candidates()
    assert len(candidates) >= 2
    fast, broken = candidates[-1], candidates[0]
    seen, ran = [], []
    multiply = Fp8Linear.forward

    def recording(self, x):
        seen.append(self.gemv_config)
        return multiply(self, x)

    def timer(fn, repeats):
        seen.clear()
        fn()
        config = seen[0] if seen else None  # none: a float module's candidates
        if config == broken:
            raise RuntimeError("out of resources")
        ran.append(config)
        return 5.0 if config == fast else 10.0

    monkeypatch.setattr(Fp8Linear, "forward", recording)
    monkeypatch.setattr(Fp8Linear, "gemv_candidates", lambda self: [broken, fast])  # fewer to run interpreted
    monkeypatch.setattr(gpu_forward, "_time_us", timer)
    chosen = gpu_forward.choose_gemv(model)
    fp8_choices = {name: c for name, c in chosen.items() if "Fp8Linear" in name}
    assert fp8_choices and all(c.best_us == c.default_us / 2 for c in fp8_choices.values())
    assert all(m.gemv_config == fast for m in projections(model) if isinstance(m, Fp8Linear))
    assert None in ran and fast in ran

    monkeypatch.setattr(gpu_forward, "_time_us", lambda fn, repeats: (fn(), 10.0)[1])
    gpu_forward.choose_gemv(model)
    assert all(m.gemv_config is None for m in projections(model) if isinstance(m, Fp8Linear))
