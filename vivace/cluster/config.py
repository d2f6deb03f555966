"""What a scaled-out server runs: the served model names, each as one or more weighted
versions with their own engine settings and replica counts (fixed, or autoscaled on queue
depth); read from a YAML file (``--config``) or made from the command line (``--replicas``).

The file::

    models:
      - name: chat                  # what clients send as "model"
        versions:
          - name: a
            weight: 80              # share of this model's traffic (> 0)
            replicas: 2             # or min_replicas / max_replicas / target_ongoing_requests
            tiers: [premium]        # optional: reserved for these API-key tiers
            engine: {model: default, num_threads: 1}   # any engine flag, underscores
    routing: prefix                 # optional: prefix, pow2 or round-robin

Every mistake is a :class:`ConfigError` naming the file, the line and the key, raised before
anything starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vivace.config import EngineConfig

ROUTING_POLICIES = ("prefix", "pow2", "round-robin")
_SCALING_KEYS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
                 "upscale_delay", "downscale_delay")


class ConfigError(ValueError):
    """A bad deployment file: ``source:line: key: problem``."""

    def __init__(self, source: str, line: int, key: str, problem: str) -> None:
        super().__init__(f"{source}:{line}: {key}: {problem}")


class ScalingError(ValueError):
    """A bad scaling setting; ``key`` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Scaling:
    """A fixed ``replicas`` count, or autoscaling between ``min_replicas`` and ``max_replicas``
    towards ``target_ongoing_requests`` per replica (defaults as Ray Serve's)."""

    replicas: int | None = 1
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0
    upscale_delay: float = 30.0
    downscale_delay: float = 600.0

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 1:
            raise ScalingError("replicas", f"replicas must be >= 1, got {self.replicas}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ScalingError("min_replicas", f"need 1 <= min_replicas <= max_replicas, got "
                                               f"{self.min_replicas} and {self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ScalingError("target_ongoing_requests",
                               f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        for key in ("upscale_delay", "downscale_delay"):
            if getattr(self, key) < 0:
                raise ScalingError(key, f"{key} must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class VersionSpec:
    """One version of a model. ``origin`` says where its model was named (for load errors)."""

    name: str
    engine: EngineConfig
    weight: float = 1.0
    scaling: Scaling = Scaling()
    tiers: tuple[str, ...] = ()
    origin: str = "the command line"


@dataclass(frozen=True)
class ModelSpec:
    """A served model name (None: the engine's own) and its versions."""

    name: str | None
    versions: tuple[VersionSpec, ...]


@dataclass(frozen=True)
class ClusterConfig:
    """Everything the scaled-out server deploys."""

    models: tuple[ModelSpec, ...]
    routing: str = "prefix"
    ray_address: str | None = None
    deployment_names: dict[tuple[int, str], str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        names = {(i, v.name): f"engine-{i}-{v.name}"
                 for i, model in enumerate(self.models) for v in model.versions}
        object.__setattr__(self, "deployment_names", names)


class _Node(dict):
    """A YAML mapping that remembers its own line and each key's."""

    def __init__(self, line: int = 1) -> None:
        super().__init__()
        self.line = line
        self.lines: dict[Any, int] = {}


class _Loader(yaml.SafeLoader):
    def construct_node_mapping(self, node: yaml.MappingNode) -> _Node:
        self.flatten_mapping(node)
        result = _Node(node.start_mark.line + 1)
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in result:
                raise yaml.MarkedYAMLError("", None, f"duplicate key {key!r}", key_node.start_mark)
            result[key] = self.construct_object(value_node, deep=True)
            result.lines[key] = key_node.start_mark.line + 1
        return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_node_mapping)


@dataclass
class _Reader:
    """Checks a parsed file, naming ``source``, the line and the key path of each mistake."""

    source: str
    engine_keys: Mapping[str, Callable[[Any], Any]]
    make_engine: Callable[[dict[str, Any]], EngineConfig]
    tiers: Collection[str]

    def fail(self, node: _Node, path: str, key: str | None, problem: str) -> ConfigError:
        line = node.lines.get(key, node.line) if key is not None else node.line
        return ConfigError(self.source, line, _join(path, key or "") or "(file)", problem)

    def mapping(self, value: Any, node: _Node, path: str, key: str, allowed: Collection[str],
                required: Collection[str] = ()) -> _Node:
        """``node[key]`` (``value``) as a mapping with keys among ``allowed``."""
        if not isinstance(value, _Node):
            raise self.fail(node, path, key, "must be a mapping")
        where = _join(path, key)
        for name in value:
            if name not in allowed:
                raise self.fail(value, where, str(name),
                                f"unknown key (expected one of {', '.join(allowed)})")
        for name in required:
            if name not in value:
                raise self.fail(value, where, None, f"missing key {name!r}")
        return value

    def items(self, node: _Node, path: str, key: str) -> list[_Node]:
        """``node[key]`` as a non-empty list of mappings."""
        value = node[key]
        if not isinstance(value, list) or not value:
            raise self.fail(node, path, key, "must be a non-empty list")
        for i, item in enumerate(value):
            if not isinstance(item, _Node):
                raise self.fail(node, path, key, f"item {i} must be a mapping")
        return value

    def config(self, document: Any) -> ClusterConfig:
        top = self.mapping(document, _Node(), "", "", ("models", "routing"), ("models",))
        routing = top.get("routing", "prefix")
        if routing not in ROUTING_POLICIES:
            raise self.fail(top, "", "routing", f"must be one of {', '.join(ROUTING_POLICIES)}")
        models, seen = [], set()
        for i, node in enumerate(self.items(top, "", "models")):
            path = f"models[{i}]"
            self.mapping(node, top, "", path, ("name", "versions"), ("name", "versions"))
            if node["name"] in seen or not isinstance(node["name"], str) or not node["name"]:
                raise self.fail(node, path, "name", "must be a unique non-empty string")
            seen.add(node["name"])
            models.append(ModelSpec(node["name"], self.versions(node, path)))
        return ClusterConfig(tuple(models), routing)

    def versions(self, model: _Node, path: str) -> tuple[VersionSpec, ...]:
        versions, seen = [], set()
        for j, node in enumerate(self.items(model, path, "versions")):
            where = f"{path}.versions[{j}]"
            self.mapping(node, model, path, f"versions[{j}]",
                         ("name", "weight", "tiers", "engine", *_SCALING_KEYS), ("name",))
            name = node["name"]
            if not isinstance(name, str) or not name or name in seen:
                raise self.fail(node, where, "name", f"duplicate or empty version name {name!r}")
            seen.add(name)
            versions.append(self.version(node, where, name))
        if all(v.tiers for v in versions):
            raise self.fail(model, path, "versions", "at least one version must be reserved for "
                            "no tier (callers of other tiers need one)")
        return tuple(versions)

    def version(self, node: _Node, where: str, name: str) -> VersionSpec:
        weight = node.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0 \
                or not math.isfinite(weight):
            raise self.fail(node, where, "weight", f"must be a number > 0, got {weight!r}")
        tiers = node.get("tiers", [])
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            raise self.fail(node, where, "tiers", "must be a list of tier names")
        unknown = [t for t in tiers if t not in self.tiers]
        if unknown:
            raise self.fail(node, where, "tiers", f"unknown tier {unknown[0]!r} (the API key "
                            f"file defines {', '.join(sorted(self.tiers))})")
        try:
            scaling = scaling_of({k: node[k] for k in _SCALING_KEYS if k in node})
        except ScalingError as exc:
            raise self.fail(node, where, exc.key, str(exc)) from None
        engine, origin = self.engine(node, where)
        return VersionSpec(name, engine, float(weight), scaling, tuple(tiers), origin)

    def engine(self, node: _Node, where: str) -> tuple[EngineConfig, str]:
        spec = self.mapping(node.get("engine", _Node()), node, where, "engine", self.engine_keys)
        values = {}
        for key, raw in spec.items():
            try:
                values[key] = self.engine_keys[key](raw)
            except (TypeError, ValueError) as exc:
                raise self.fail(spec, f"{where}.engine", key, f"bad value {raw!r}: {exc}") from None
        model_line = spec.lines.get("model", spec.line or node.line)
        model = values.get("model")
        if model is not None and model != "default" and not Path(model).exists():
            raise ConfigError(self.source, model_line, f"{where}.engine.model",
                              f"no such model file or directory: {model}")
        try:
            engine = self.make_engine(values)
        except (TypeError, ValueError) as exc:
            raise self.fail(node, where, "engine", str(exc)) from None
        return engine, f"{self.source}:{model_line} ({where})"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def scaling_of(values: Mapping[str, Any]) -> Scaling:
    """A Scaling from ``values`` (keys of ``Scaling``; None ones left out): a fixed count,
    or autoscaling when any autoscaling key is given. Raises ScalingError naming a bad key:
    every value a finite number, replica counts whole ones."""
    given = {k: v for k, v in values.items() if v is not None}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ScalingError(key, f"{key} must be a finite number, got {value!r}")
        if key in _SCALING_KEYS[:3] and value != int(value):
            raise ScalingError(key, f"{key} must be a whole number, got {value!r}")
    autoscaling = given.keys() - {"replicas"}
    if "replicas" in given and autoscaling:
        raise ScalingError("replicas", f"give either replicas or {', '.join(sorted(autoscaling))}, not both")
    if not autoscaling:
        return Scaling(int(given.get("replicas", 1)))
    low = int(given.get("min_replicas", 1))
    return Scaling(None, low, int(given.get("max_replicas", low)),
                   **{k: float(given[k]) for k in _SCALING_KEYS[3:] if k in given})


def load_config(path: str, engine_keys: Mapping[str, Callable[[Any], Any]],
                make_engine: Callable[[dict[str, Any]], EngineConfig],
                tiers: Collection[str]) -> ClusterConfig:
    """The deployment file at ``path``. ``engine_keys`` maps each ``engine:`` key to its
    parser, ``make_engine`` builds a version's EngineConfig from the keys it gave, ``tiers``
    are the tier names API keys can have. Raises ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(path, 0, "(file)", f"cannot read it: {exc.strerror}") from None
    try:
        document = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise ConfigError(path, mark.line + 1 if mark else 0, "(file)", exc.problem or str(exc)) from None
    return _Reader(path, engine_keys, make_engine, tiers).config(document)


def from_flags(args: argparse.Namespace, engine: EngineConfig, served_name: str | None) -> ClusterConfig:
    """One model (``served_name``, or the engine's own name) in one version, "default", with
    the command line's replica flags."""
    scaling = scaling_of({k: getattr(args, k) for k in _SCALING_KEYS})
    version = VersionSpec("default", engine, scaling=scaling)
    return ClusterConfig((ModelSpec(served_name, (version,)),), args.routing or "prefix",
                         args.ray_address)
