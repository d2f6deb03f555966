"""The decode forward compiled ahead of time (AOTInductor) and cached on disk as a ``.pt2`` package.

One graph serves 1 to ``max_batch`` sequences: batch, KV pool size and block-table width are
symbolic (every op that reads them is opaque), so a changed KV budget or context length reuses
the artifact. Loading it takes milliseconds, where ``torch.compile`` re-traces the 30 layers with
dynamo and reloads inductor's cache on every start (about 12 s here).

The package holds code, never weights: its constants are bound, without a copy, to the live
model's tensors at load time (``user_managed``), so the artifact depends only on what shapes the
graph (module structure, tensor metadata, KV layout, vivace's graph code, torch version, CPU),
and all of that is in its file name. A package that fails to load is rebuilt; a model whose
weights are not plain strided tensors (oneDNN-prepacked float linears) is not supported here.

A server need not wait for the compile: ``BackgroundBuild`` runs it in a child process at the
lowest CPU priority (``python -m vivace.engine.aot_decode``, which loads the same model from the
engine's config and writes the package), so it holds neither the server's GIL nor much of its
CPU; the runner decodes eagerly until the package is there and loads it between two steps.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

import vivace
from vivace.cache import cache_dir
from vivace.layers import decode_attention, native
from vivace.layers.attention import DecodeMetadata
from vivace.layers.native import cpu_flags

if TYPE_CHECKING:
    from vivace.config import EngineConfig

ARTIFACT_VERSION = 1
# What shapes the graph: the model code, layers and kernels, and this file.
_GRAPH_SOURCES = ("models", "layers", "kernels", "engine/aot_decode.py")

logger = logging.getLogger(__name__)


@functools.cache
def _native_runner() -> bool:
    """Whether vivace's package runner (``aoti_runner.cpp``: runs release the GIL) is loaded."""
    return native.load("aoti_runner")


def default_cache_dir() -> Path:
    return cache_dir("aoti")


def decode_logits(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                  kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, prompt_rows: torch.Tensor,
                  logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits ``[num_seqs, vocab]``, or of the rows ``logit_rows`` only: the decode
    forward every compiled graph captures (``prompt_rows``: ``DecodeMetadata``'s)."""
    meta = DecodeMetadata(slot_mapping, block_tables, seq_lens, prompt_rows)
    hidden = model(input_ids, positions, kv_caches, meta)
    return model.compute_logits(hidden if logit_rows is None else hidden.index_select(0, logit_rows))


class _DecodeForward(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                prompt_rows: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        return decode_logits(self.model, input_ids, positions, kv_caches, slot_mapping, block_tables, seq_lens,
                             prompt_rows, logit_rows)


def supported(model: nn.Module) -> bool:
    """Whether every weight can be bound to a package: plain strided tensors only."""
    return all(t.layout == torch.strided for t in _constants(model).values())


def _constants(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by the names the exported graph gives them."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return {f"model.{name}": tensor for name, tensor in tensors.items() if tensor is not None}


def _source_digest() -> str:
    root = Path(vivace.__file__).parent
    digest = hashlib.sha256()
    for entry in _GRAPH_SOURCES:
        path = root / entry
        for file in sorted(path.rglob("*") if path.is_dir() else [path]):
            if file.suffix in (".py", ".cpp", ".h"):
                digest.update(str(file.relative_to(root)).encode() + file.read_bytes())
    return digest.hexdigest()


def artifact_key(model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int) -> str:
    """A digest of everything the compiled graph depends on, weights' values excepted."""
    kv = kv_caches[0]
    description = {
        "artifact": ARTIFACT_VERSION,
        "torch": torch.__version__,
        "vivace": _package_version(),
        "source": _source_digest(),
        "cpu": sorted(cpu_flags()),
        "attention": decode_attention.BACKEND,
        "model": repr(model),
        "config": repr(getattr(model, "config", None)),
        "tensors": [(name, t.dtype, tuple(t.shape), t.stride()) for name, t in _constants(model).items()],
        # The KV pool size (dim 1) is symbolic.
        "kv": (len(kv_caches), kv.dtype, kv.shape[:1] + kv.shape[2:]),
        "max_batch": max_batch,
    }
    return hashlib.sha256(json.dumps(description, default=str).encode()).hexdigest()[:24]


def package_path(model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
                 cache_dir: Path | None = None) -> Path:
    """Where the package of this model's decode graph is (or will be) cached."""
    return (cache_dir or default_cache_dir()) / f"decode-{artifact_key(model, kv_caches, max_batch)}.pt2"


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vivace")
    except PackageNotFoundError:
        return "unknown"


class AOTDecoder:
    """Runs the packaged decode graph of ``model`` over ``kv_caches`` for 1 to ``max_batch``
    sequences, loaded from ``cache_dir`` or compiled into it first (a cold start: tens of seconds).
    Raises whatever export or compilation raises when the graph cannot be built, and, with
    ``compile_missing`` False, what loading raises instead of compiling."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
                 cache_dir: Path | None = None, compile_missing: bool = True) -> None:
        self.kv_caches = kv_caches
        self.path = package_path(model, kv_caches, max_batch, cache_dir)
        start = time.perf_counter()
        try:
            self._loader = self._load(model)
            logger.info("vivace: decode graph loaded from %s in %.2f s", self.path, time.perf_counter() - start)
            return
        except Exception as exc:  # missing, corrupt or incompatible: build it afresh
            if not compile_missing:
                raise
            if self.path.exists():
                logger.warning("vivace: decode graph %s did not load (%s); compiling it again", self.path, exc)
        logger.info("vivace: compiling the decode graph (once per model, flags and machine; a minute or more)...")
        build(model, kv_caches, max_batch, self.path)
        self._loader = self._load(model)
        logger.info("vivace: decode graph compiled to %s in %.1f s", self.path, time.perf_counter() - start)

    def _load(self, model: nn.Module) -> torch._C._aoti.AOTIModelPackageLoader | int:
        """The package opened with its constants bound to ``model``'s tensors: a handle of
        vivace's runner (``aoti_runner.cpp``, which runs without the GIL), or torch's loader where
        that library did not build."""
        constants = _constants(model)
        if _native_runner():
            handle = torch.ops.vivace.aoti_open(str(self.path), list(constants), list(constants.values()))
            weakref.finalize(self, torch.ops.vivace.aoti_close, handle)
            return handle
        # The C++ loader directly: ``torch._inductor.aoti_load_package`` first imports inductor (~1 s).
        loader = torch._C._aoti.AOTIModelPackageLoader(str(self.path), "model", False, 1, -1)
        missing = set(loader.get_constant_fqns()) - set(constants)
        if missing:
            raise RuntimeError(f"the package expects tensors the model lacks: {sorted(missing)[:4]}")
        # user_managed: the package reads the model's own tensors, no copy. By keyword: torch
        # 2.13 added a fifth argument (allow_h2d_copy) that 2.11 lacks.
        loader.load_constants({name: constants[name] for name in loader.get_constant_fqns()},
                              use_inactive=False, check_full_update=True, user_managed=True)
        return loader

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, prompt_rows: torch.Tensor,
                 logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[num_seqs, vocab]``, or ``[len(logit_rows), vocab]`` of those rows
        only (a prompt chunk's rows need none); writes each row's new K/V into the caches."""
        if logit_rows is None:
            logit_rows = torch.arange(len(input_ids))
        inputs = [input_ids, positions, *self.kv_caches, slot_mapping, block_tables, seq_lens, prompt_rows, logit_rows]
        if isinstance(self._loader, int):
            return torch.ops.vivace.aoti_run(self._loader, inputs)[0]
        return self._loader.boxed_run(inputs)[0]


def build(model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int, path: Path) -> None:
    """Export the decode forward with symbolic batch, pool size and table width, compile it with
    AOTInductor (weights left out of the package) and write it to ``path`` atomically."""
    import torch._inductor
    from torch.export import Dim

    # The example is 2 rows asking for 3 logit rows (not 1 and 2, which export would specialize
    # on), so each range holds its example even where max_batch is 1 or 2.
    example_batch, example_rows = 2, 3
    batch, pool, width = (Dim("batch", min=1, max=max(max_batch, example_batch)), Dim("num_blocks", min=2),
                          Dim("width", min=1))
    rows = Dim("logit_rows", min=1, max=max(max_batch, example_rows))
    longs = [torch.zeros(example_batch, dtype=torch.long) for _ in range(4)]
    scratch = kv_caches[0].shape[1] - 1
    tables = torch.full((example_batch, 2), scratch, dtype=torch.long)
    args = (longs[0], longs[1], kv_caches, longs[2], tables, longs[2] + 1, longs[3], torch.arange(example_rows) % example_batch)
    dynamic = ({0: batch}, {0: batch}, [{1: pool}] * len(kv_caches), {0: batch}, {0: batch, 1: width}, {0: batch},
               {0: batch}, {0: rows})
    with torch.no_grad():
        exported = torch.export.export(_DecodeForward(model), args, dynamic_shapes=dynamic, strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(partial),
                                                 inductor_configs={"aot_inductor.package_constants_in_so": False})
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


class BackgroundBuild:
    """The package at ``path`` compiled by a child process at the lowest CPU priority, for the
    model ``config`` loads and ``max_batch`` rows (what the caller's runner has: the child checks
    that its artifact key gives ``path``). ``poll`` says whether it has finished and succeeded."""

    def __init__(self, config: EngineConfig, max_batch: int, path: Path) -> None:
        self.path = path
        self.max_batch = max_batch
        self.start = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._config_file = path.with_name(f"{path.stem}.{os.getpid()}.config.pickle")
        self._config_file.write_bytes(pickle.dumps(config))
        # The child's stdin is a pipe only this process writes: it reads end-of-file when this
        # process ends, however it ends, and then stops (see _exit_with_parent).
        self._process = subprocess.Popen([sys.executable, "-m", __name__, str(self._config_file), str(max_batch),
                                          str(path)], stdin=subprocess.PIPE)

    def poll(self) -> bool | None:
        """None while the child runs; then whether the package is there (logged once)."""
        code = self._process.poll()
        if code is None:
            return None
        self._config_file.unlink(missing_ok=True)
        if code == 0 and self.path.exists():
            logger.info("vivace: decode graph compiled in the background in %.1f s", time.perf_counter() - self.start)
            return True
        logger.warning("vivace: the background decode-graph compile failed (exit status %s); decoding stays eager",
                       code)
        return False


def _exit_with_parent() -> None:
    """Ends this child when its parent does: its stdin, the parent's pipe, then reads end-of-file."""
    while os.read(0, 4096):  # unbuffered: no lock for interpreter shutdown to trip over
        pass
    os._exit(3)


def _build_in_child(config_file: Path, max_batch: int, path: Path) -> int:
    """``BackgroundBuild``'s child: load the engine's model, check the artifact key, compile."""
    import threading

    threading.Thread(target=_exit_with_parent, daemon=True).start()
    os.nice(19)  # behind every step of the server that started it
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s [decode-graph compile]: %(message)s")
    from vivace.engine import backend
    from vivace.engine.runner import allocate_kv_cache
    from vivace.models.llama import kv_cache_shape

    config = pickle.loads(config_file.read_bytes())
    config_file.unlink(missing_ok=True)  # read: gone even if the server is killed before it polls
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    loaded = backend.load(config)
    # The pool size is symbolic: two blocks and the scratch one give the same graph.
    shape = kv_cache_shape(loaded.config, 3, config.block_size)
    kv_caches = [allocate_kv_cache(shape, config.kv_torch_dtype) for _ in range(loaded.config.num_hidden_layers)]
    if package_path(loaded.model, kv_caches, max_batch, path.parent) != path:
        logger.error("vivace: the model loaded here is not the server's (artifact key differs); not compiling")
        return 1
    start = time.perf_counter()
    logger.info("vivace: compiling the decode graph at low priority while the server decodes eagerly...")
    build(loaded.model, kv_caches, max_batch, path)
    logger.info("vivace: decode graph compiled to %s in %.1f s", path, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    try:
        status = _build_in_child(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    except BaseException:
        logger.exception("vivace: the background decode-graph compile failed")
        status = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # now: inductor's compile workers and exit hooks can hold a normal exit for long
