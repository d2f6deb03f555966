"""``--api-key-file`` in both formats, tier validation, and how a tier sets a priority."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vivace.cli import parse_args, server_settings
from vivace.server.tiers import Tier, load_api_key_file

TIERED = {
    "tiers": {"default": {"requests_per_minute": 100},
              "premium": {"priority": 0, "max_concurrency": 16},
              "free": {"priority": 10, "max_concurrency": 2, "requests_per_minute": 30,
                       "tokens_per_minute": 20000, "max_queue_delay": 2.5}},
    "keys": {"sk-premium": "premium", "sk-free": "free", "sk-ops": "default"},
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text, encoding="utf-8")
    return path


def test_plain_file_is_one_key_a_line_in_the_default_tier(tmp_path: Path) -> None:
    loaded = load_api_key_file(write(tmp_path, "# comment\nk1\n\n  k2  \n"))
    assert loaded.keys == ("k1", "k2") and not loaded.key_tiers and loaded.default_tier == Tier()


def test_json_file_maps_keys_to_tiers(tmp_path: Path) -> None:
    loaded = load_api_key_file(write(tmp_path, json.dumps(TIERED)))
    assert loaded.keys == ("sk-premium", "sk-free", "sk-ops")
    free = loaded.key_tiers["sk-free"]
    assert (free.name, free.priority, free.max_concurrency, free.max_queue_delay) == ("free", 10, 2, 2.5)
    assert loaded.key_tiers["sk-ops"] is loaded.default_tier
    assert loaded.default_tier.requests_per_minute == 100


@pytest.mark.parametrize("document, message", [
    ({"keys": {"k": "gold"}}, "unknown tier"),
    ({"tiers": {"t": {"speed": 1}}}, "fields among"),
    ({"tiers": {"t": {"max_concurrency": 0}}}, "must be a number > 0"),
    ({"tiers": {"t": {"priority": 1.5}}}, "must be an integer"),
    ({"tiers": [], "keys": {}}, "must be a JSON object"),
    ({"users": {}}, '"tiers" and "keys" only'),
])
def test_bad_json_files_name_the_problem(tmp_path: Path, document: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_api_key_file(write(tmp_path, json.dumps(document)))


def test_a_tier_priority_is_the_default_and_the_floor() -> None:
    free = Tier("free", priority=10)
    assert (free.priority_of(None), free.priority_of(20), free.priority_of(-5)) == (10, 20, 10)
    anyone = Tier()
    assert (anyone.priority_of(None), anyone.priority_of(-5)) == (0, -5)


def test_serve_flags_build_tiered_settings(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(TIERED))
    args = parse_args(["serve", "--api-key", "flag-key", "--api-key-file", str(path),
                       "--max-waiting-requests", "8", "--request-timeout", "30"])
    settings = server_settings(args)
    assert settings.api_keys == ("flag-key", "sk-premium", "sk-free", "sk-ops")
    assert settings.tier_of("sk-free").name == "free"
    assert settings.tier_of("flag-key").requests_per_minute == 100  # the file's default tier
    assert (settings.max_waiting_requests, settings.request_timeout_s) == (8, 30.0)
