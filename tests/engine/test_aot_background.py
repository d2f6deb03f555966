"""A decode graph compiled in the background: the engine decodes eagerly at once, takes the
package up between two steps when the child process has written it, relearns its pacer, and its
greedy tokens are the same before and after.

Named to run before test_aot_decode: the package the child compiles here then seeds the session's
cache, where test_aot_decode and test_compiled load it instead of compiling it again (~20 s)."""

import os
import shutil

import pytest

from vivace import LLM, SamplingParams
from vivace import cache
from vivace.engine import aot_decode
from vivace.engine.compiled import CompiledDecoder

from tests.engine.test_compiled import MAX_BATCH, prompts

pytestmark = pytest.mark.slow  # the child process compiles the tiny model's package (~20 s)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """An empty cache but for the native libraries this process already built (the child loads
    them from there instead of building them again)."""
    cold = tmp_path_factory.mktemp("cache")
    kernels = cache.cache_dir("kernels")
    (cold / "vivace").mkdir()
    (cold / "vivace" / "kernels").symlink_to(kernels, target_is_directory=True)
    packages = aot_decode.default_cache_dir()
    yield cold
    for package in (cold / "vivace" / "aoti").glob("*.pt2"):  # seeds the session's cache
        if not (packages / package.name).exists():
            packages.mkdir(parents=True, exist_ok=True)
            shutil.copy(package, packages / f"{package.stem}.{os.getpid()}.partial")
            os.replace(packages / f"{package.stem}.{os.getpid()}.partial", packages / package.name)


def test_eager_until_the_package_is_there_then_compiled(tiny_model_dir, cache_dir, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir))  # a cold cache, which the child inherits
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = prompts(3, seed=3)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, quantization="int8", compile=True,
              max_num_seqs=MAX_BATCH, background_compile=True)
    runner = llm.engine.runner
    build = runner.pending_compile
    assert build is not None and runner.decoder is None and llm.engine.scheduler.pacer.compiled_rows == 0
    eager = [o.outputs[0].token_ids for o in llm.generate(batch, params)]  # served while it compiles

    assert build._process.wait(timeout=600) == 0
    assert build.path.exists() and build.path.parent == aot_decode.default_cache_dir()
    assert not list(build.path.parent.glob("*.config.pickle"))  # the child removed what it read
    calls = []
    original = CompiledDecoder.__call__
    monkeypatch.setattr(CompiledDecoder, "__call__", lambda self, *a: calls.append(len(a[0])) or original(self, *a))
    compiled = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert runner.pending_compile is None and runner.decoder.backend == "aot"
    assert llm.engine.scheduler.pacer.compiled_rows == MAX_BATCH  # a new pacer, for compiled steps
    assert calls and compiled == eager
    llm.check_integrity()


def test_a_cached_package_is_loaded_at_start_not_compiled_again(tiny_model_dir, cache_dir, monkeypatch):
    """With the package on disk, no child: the engine starts compiled, as without the option."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir))
    options = dict(num_kv_blocks=64, block_size=4, quantization="int8", compile=True, max_num_seqs=MAX_BATCH)
    first = LLM(str(tiny_model_dir), **options)  # loads the previous test's package (or compiles it here)
    assert first.engine.runner.decoder.backend == "aot"
    again = LLM(str(tiny_model_dir), background_compile=True, **options)
    assert again.engine.runner.pending_compile is None and again.engine.runner.decoder.backend == "aot"
