"""The CUDA backend's tests run on the GPU where there is one, else on CPU tensors under Triton's
interpreter, which must be switched on before any kernel is decorated (and stay on while they
run). Every test here is marked ``cuda``: ``pytest -m cuda`` on a GPU machine runs them there."""

from __future__ import annotations

import inspect
import os
import threading

import pytest
import torch
import transformers
from packaging.version import Version

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# transformers before 5.18 cannot read the tokenizer of a Phi-3 GGUF (its converter asks the file
# for a pad token it never parsed) or of a Granite GGUF (not among its GGUF architectures), which
# vivace's GGUF loader takes from it; pyproject.toml asks for 5.18 or later, the GPU machine's
# image has 5.17.
GGUF_TOKENIZERS_OF_5_18 = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.18"),
    reason="transformers < 5.18 reads no Phi-3 or Granite GGUF tokenizer (vivace asks for 5.18)")


def _index_one_element_blocks() -> None:
    """Let the interpreter of Triton before 3.7 (3.6 is the GPU machine's) take a loop bound
    computed from a program id or a load: it converts the bound's numpy data with ``int()``, which
    refuses the one-element arrays those give, where later versions squeeze them first. Changes
    nothing where the interpreter squeezes already, or is off."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if "squeeze" in inspect.getsource(patch_tensor):
        return

    def patch_with_index(tensor: type, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_with_index


def _patch_the_language_once_per_launch() -> None:
    """The interpreter patches triton.language for each launch (and undoes it when the launch
    ends), then again at every call of a ``@triton.jit`` helper inside it, where it finds the same
    modules patched already: about a third of the runner tests' time. Here a helper's call patches
    only the modules its launch has not; the launch itself patches and restores as before.
    Changes nothing where a helper's call does not patch the language."""
    from triton import language
    from triton.runtime import interpreter

    helper_call = getattr(getattr(interpreter, "InterpretedFunction", None), "__call__", None)
    if (helper_call is None or not hasattr(interpreter, "_LangPatchScope")
            or "_patch_lang(self.fn)" not in inspect.getsource(helper_call)):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    running = threading.local()  # .patched: ids of the modules the launch on this thread patched

    def lang_modules(fn: object) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if value is language or value is language.core}

    def patch_lang_once(fn: object) -> object:
        modules, patched = lang_modules(fn), getattr(running, "patched", None)
        if patched is None:
            return patch_lang(fn)
        if modules and modules <= patched:
            return interpreter._LangPatchScope()  # nothing patched here, nothing to restore
        patched.update(modules)
        return patch_lang(fn)

    def launch_patching_once(self: object, *args: object, **kwargs: object) -> None:
        running.patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.patched = None

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_patching_once


if DEVICE == "cpu":
    _index_one_element_blocks()
    _patch_the_language_once_per_launch()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
