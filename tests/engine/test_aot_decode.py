"""The AOTInductor decode package: its cache key, rebuilding a bad package, weights bound at load."""

import logging
import shutil

import pytest
import torch

from vivace.engine import aot_decode
from vivace.engine.aot_decode import AOTDecoder, artifact_key
from vivace.engine.compiled import CompiledDecoder
from vivace.engine.runner import ModelRunner
from vivace.models import load_model

MAX_BATCH = 4
# The int8 layers quantize their activations per group of 32: where the compiled graph's floats
# differ from eager's in the last bits (another summation order in a norm), a value on a rounding
# boundary takes the next code, moving the logits by up to ~1% of their scale (seen on an AVX2
# CPU's build). Far below what a wrong weight or cache row gives (the logits' own scale).
LOGITS = dict(rtol=0, atol=5e-2)


def quantized_runner(model_dir, mode: str = "int8", num_blocks: int = 16, block_size: int = 4,
                     kv_dtype: torch.dtype = torch.float16) -> ModelRunner:
    """float16 KV by default, as an engine's on CPU: the package is then the one test_compiled's
    int8 engines of MAX_BATCH sequences load."""
    return ModelRunner(load_model(str(model_dir), torch.float32, mode), num_blocks, block_size, kv_dtype,
                       max_model_len=64)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return quantized_runner(tiny_model_dir)


@pytest.fixture(scope="module")
def other_weights(make_tiny_llama):
    """A runner of the same architecture with other weights (seed 1)."""
    return quantized_runner(make_tiny_llama(seed=1))


@pytest.fixture(scope="module")
def package_dir(runner, tmp_path_factory):
    """A cache directory holding only the package of ``runner``'s model: a copy of the one in
    vivace's own cache (compiled there first where it is missing, ~20 s, which test_compiled's
    engines then load instead of compiling it again)."""
    cache = tmp_path_factory.mktemp("aoti")
    shutil.copy(AOTDecoder(runner.model, runner.kv_caches, MAX_BATCH).path, cache)
    return cache


def decode_both(runner: ModelRunner, decoder: AOTDecoder, ids=(11, 12, 13), positions=(9, 6, 2),
                tables=((0, 1, 2), (4, 5), (6,))) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the same decode batch from ``decoder`` and eagerly, from the same caches."""
    ids, positions, tables = list(ids), list(positions), [list(table) for table in tables]
    generator = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    before = [cache.clone() for cache in runner.kv_caches]
    with torch.inference_mode():
        input_ids, pos, meta = runner.build_decode_inputs(ids, positions, tables, runner.max_blocks_per_seq)
        compiled = decoder(input_ids, pos, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.prompt_rows)
        for cache, old in zip(runner.kv_caches, before):
            cache.copy_(old)
        eager = runner.decode(ids, positions, tables)
    return compiled, eager


def test_key_follows_what_shapes_the_graph(runner, other_weights, tiny_model_dir, make_tiny_llama, monkeypatch):
    key = artifact_key(runner.model, runner.kv_caches, MAX_BATCH)
    # The KV pool size is symbolic in the graph, and weights are bound at load: neither is in the key.
    assert artifact_key(runner.model, quantized_runner(tiny_model_dir, num_blocks=40).kv_caches, MAX_BATCH) == key
    assert artifact_key(other_weights.model, other_weights.kv_caches, MAX_BATCH) == key
    changed = {
        "max batch": artifact_key(runner.model, runner.kv_caches, MAX_BATCH + 1),
        "block size": artifact_key(runner.model, quantized_runner(tiny_model_dir, block_size=8).kv_caches, MAX_BATCH),
        "kv dtype": artifact_key(runner.model, quantized_runner(tiny_model_dir, kv_dtype=torch.bfloat16).kv_caches,
                                 MAX_BATCH),
        "quantization": artifact_key(quantized_runner(tiny_model_dir, "int4").model, runner.kv_caches, MAX_BATCH),
        "architecture": artifact_key(quantized_runner(make_tiny_llama(num_hidden_layers=3)).model,
                                     runner.kv_caches, MAX_BATCH),
    }
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    changed["torch version"] = artifact_key(runner.model, runner.kv_caches, MAX_BATCH)
    monkeypatch.undo()
    monkeypatch.setattr(aot_decode, "_source_digest", lambda: "edited")
    changed["graph code"] = artifact_key(runner.model, runner.kv_caches, MAX_BATCH)
    assert key not in changed.values()
    assert len(set(changed.values())) == len(changed)


def test_package_runs_on_the_weights_it_is_loaded_with(package_dir, other_weights):
    decoder = AOTDecoder(other_weights.model, other_weights.kv_caches, MAX_BATCH, package_dir)
    assert decoder.path.parent == package_dir  # the same package, no new compile
    assert len(list(package_dir.iterdir())) == 1
    compiled, eager = decode_both(other_weights, decoder)
    torch.testing.assert_close(compiled, eager, **LOGITS)


def test_vivace_runner_runs_the_package_as_torchs_loader_does(runner, package_dir, monkeypatch):
    """The package runs through ``aoti_runner.cpp`` (which releases the GIL for the run) where it
    built, and gives what torch's own loader gives."""
    decoder = AOTDecoder(runner.model, runner.kv_caches, MAX_BATCH, package_dir)
    assert isinstance(decoder._loader, int) == aot_decode._native_runner()
    native, eager = decode_both(runner, decoder)
    monkeypatch.setattr(aot_decode, "_native_runner", lambda: False)
    torch_loader = AOTDecoder(runner.model, runner.kv_caches, MAX_BATCH, package_dir)
    assert not isinstance(torch_loader._loader, int)
    theirs, theirs_eager = decode_both(runner, torch_loader)  # fresh random caches: its own eager reference
    torch.testing.assert_close(native, eager, **LOGITS)
    torch.testing.assert_close(theirs, theirs_eager, **LOGITS)


def test_a_corrupt_package_is_rebuilt(runner, package_dir, tmp_path, monkeypatch, caplog):
    good = next(package_dir.iterdir())
    broken = tmp_path / good.name
    broken.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    rebuilt = []
    monkeypatch.setattr(aot_decode, "build", lambda *args: rebuilt.append(args[-1]) or args[-1].write_bytes(
        good.read_bytes()))  # stands in for the ~10 s compile
    with caplog.at_level(logging.WARNING):
        decoder = AOTDecoder(runner.model, runner.kv_caches, MAX_BATCH, tmp_path)
    assert rebuilt == [broken] and "did not load" in caplog.text
    compiled, eager = decode_both(runner, decoder)
    torch.testing.assert_close(compiled, eager, **LOGITS)


def test_a_package_that_cannot_be_built_raises(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(aot_decode, "build", lambda *args: (_ for _ in ()).throw(RuntimeError("no compiler")))
    with pytest.raises(RuntimeError, match="no compiler"):
        AOTDecoder(runner.model, runner.kv_caches, MAX_BATCH, tmp_path)


def test_a_one_sequence_server_gets_its_package(runner, tmp_path):
    """``--max-num-seqs 1`` (a lone voice agent's server): the package builds for that range too,
    rather than falling back to torch.compile, and its one row matches eager."""
    decoder = AOTDecoder(runner.model, runner.kv_caches, 1, tmp_path)
    compiled, eager = decode_both(runner, decoder, ids=[11], positions=[9], tables=[[0, 1, 2]])
    torch.testing.assert_close(compiled, eager, **LOGITS)


def test_decoder_falls_back_to_torch_compile(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(aot_decode, "build", lambda *args: (_ for _ in ()).throw(RuntimeError("no compiler")))
    assert CompiledDecoder(runner.model, runner.kv_caches, MAX_BATCH, tmp_path).backend == "dynamo"
