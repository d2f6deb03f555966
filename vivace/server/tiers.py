"""API keys and their tiers: what ``--api-key-file`` holds, and what each tier allows.

The file is either the plain format, one key a line (``#`` starts a comment), every key in
the ``default`` tier; or a JSON object that names tiers and maps keys to them::

    {"tiers": {"premium": {"priority": 0, "max_concurrency": 16},
               "free": {"priority": 10, "max_concurrency": 2, "requests_per_minute": 30,
                        "tokens_per_minute": 20000, "max_queue_delay": 5}},
     "keys": {"sk-premium-1": "premium", "sk-free-1": "free", "sk-ops": "default"}}

A tier named ``default`` applies to keys without a tier (``--api-key`` ones, plain-file ones)
and, when no key is configured at all, to every request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

DEFAULT_TIER = "default"


@dataclass(frozen=True)
class Tier:
    """What the keys of one tier may do; a limit of None is no limit.

    ``priority`` is both the default and the floor of its requests' priority (lower is
    sooner): a request may ask to go later, never sooner. None lets requests choose (default
    0). Rate limits are token buckets holding a minute's worth. ``max_queue_delay`` is how
    many seconds a request may wait to be scheduled before it is ended with a 503.
    """

    name: str = DEFAULT_TIER
    priority: int | None = None
    max_concurrency: int | None = None
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_queue_delay: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "requests_per_minute", "tokens_per_minute", "max_queue_delay"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise ValueError(f"tier {self.name!r}: {name} must be a number > 0, got {value!r}")
        if self.priority is not None and (isinstance(self.priority, bool) or not isinstance(self.priority, int)):
            raise ValueError(f"tier {self.name!r}: priority must be an integer, got {self.priority!r}")

    def priority_of(self, requested: int | None) -> int:
        """The priority a request of this tier runs at, given the one it asked for (or None)."""
        if self.priority is None:
            return 0 if requested is None else requested
        return self.priority if requested is None else max(requested, self.priority)


@dataclass(frozen=True)
class ApiKeyFile:
    """The keys of an ``--api-key-file``, the tier of each key that names one, and the
    default tier."""

    keys: tuple[str, ...] = ()
    key_tiers: Mapping[str, Tier] = field(default_factory=dict)
    default_tier: Tier = Tier()


def load_api_key_file(path: str | Path) -> ApiKeyFile:
    """Reads either format (see the module docstring); raises ValueError naming what is wrong."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        return parse_tiered_keys(text)
    keys = (line.strip() for line in text.splitlines())
    return ApiKeyFile(tuple(key for key in keys if key and not key.startswith("#")))


def parse_tiered_keys(text: str) -> ApiKeyFile:
    """The JSON format: ``{"tiers": {name: {limits}}, "keys": {key: tier name}}``."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the API key file is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or set(document) - {"tiers", "keys"}:
        raise ValueError('the API key file must be an object with "tiers" and "keys" only')
    tiers = {name: _tier(name, spec) for name, spec in _object(document, "tiers").items()}
    default = tiers.get(DEFAULT_TIER, Tier())
    key_tiers: dict[str, Tier] = {}
    for key, name in _object(document, "keys").items():
        if not key:
            raise ValueError("API keys must not be empty")
        if name != DEFAULT_TIER and name not in tiers:
            raise ValueError(f"key {key[:4]}... names the unknown tier {name!r}")
        key_tiers[key] = tiers.get(name, default)
    return ApiKeyFile(tuple(key_tiers), key_tiers, default)


def _object(document: dict, name: str) -> dict:
    value = document.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f'"{name}" must be a JSON object')
    return value


def _tier(name: str, spec: object) -> Tier:
    known = {f.name for f in fields(Tier)} - {"name"}
    if not isinstance(spec, dict) or set(spec) - known:
        raise ValueError(f"tier {name!r} must be an object with fields among {sorted(known)}")
    return Tier(name=name, **spec)
