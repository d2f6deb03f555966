"""The routing policies' own logic, without a cluster: block hashing, the prefix table,
weighted version choice with tiers, and replica-count settings."""

from __future__ import annotations

from collections import Counter

import pytest

from vivace.cluster.client import ServedModel, Version
from vivace.cluster.config import Scaling, scaling_of
from vivace.cluster.router import BlockTable, block_hashes


def test_block_hashes_cover_whole_blocks_and_chain_their_prefix() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the last 8 tokens fill no block
    b = block_hashes(list(range(16)) + [99] * 24, 16)
    assert b[0] == a[0] and b[1] != a[1]
    c = block_hashes([99] * 16 + list(range(16, 32)), 16)
    assert c[1] != a[1]  # the same second block after another first one
    salted = block_hashes(list(range(40)), 16, "tenant-a")
    assert salted == block_hashes(list(range(40)), 16, "tenant-a")
    assert not set(salted) & (set(a) | set(block_hashes(list(range(40)), 16, "tenant-b")))


def test_table_finds_the_longest_held_prefix_and_forgets() -> None:
    table = BlockTable(capacity=3)
    short, long = block_hashes(list(range(32)), 16), block_hashes(list(range(64)), 16)
    table.add("r1", short)
    table.add("r2", long[:3])
    assert table.longest_match(long, {"r1", "r2"}) == ({"r2"}, 3)
    assert table.longest_match(long, {"r1"}) == ({"r1"}, 2)
    assert table.longest_match(block_hashes([7] * 32, 16), {"r1", "r2"}) == (set(), 0)
    table.add("r2", block_hashes([5] * 32, 16))  # capacity 3: r2's oldest blocks go
    assert table.longest_match(long, {"r2"}) == (set(), 0)
    table.forget("r1")
    assert table.longest_match(short, {"r1", "r2"}) == (set(), 0)


def test_weights_are_followed_exactly_and_interleaved() -> None:
    model = ServedModel("chat", [Version("a", 80), Version("b", 20), Version("fast", 1, ("premium",))])
    picks = [model.pick("default") for _ in range(100)]
    assert Counter(picks) == {"a": 80, "b": 20}
    assert max(len(run) for run in "".join(p[0] for p in picks).split("b")) <= 4
    assert {model.pick("premium") for _ in range(5)} == {"fast"}


@pytest.mark.parametrize("values,expected", [
    ({}, Scaling(1)),
    ({"replicas": 3}, Scaling(3)),
    ({"min_replicas": 1, "max_replicas": 4, "upscale_delay": 1},
     Scaling(None, 1, 4, upscale_delay=1.0)),
    ({"target_ongoing_requests": 8, "replicas": None}, Scaling(None, 1, 1, 8.0)),
])
def test_scaling_settings(values: dict, expected: Scaling) -> None:
    assert scaling_of(values) == expected


@pytest.mark.parametrize("values", [{"replicas": 2, "max_replicas": 3}, {"replicas": 0},
                                    {"min_replicas": 3, "max_replicas": 2}, {"replicas": "two"}])
def test_bad_scaling_settings_are_refused(values: dict) -> None:
    with pytest.raises((TypeError, ValueError)):
        scaling_of(values)


def test_replica_flags_make_one_model_in_one_version() -> None:
    from vivace.cli import engine_config, parse_args
    from vivace.cluster.config import from_flags

    args = parse_args(["serve", "m", "--replicas", "2", "--routing", "pow2", "--num-threads", "1"])
    config = from_flags(args, engine_config(args), "chat")
    (model,) = config.models
    (version,) = model.versions
    assert (model.name, version.name, version.scaling, config.routing) == ("chat", "default", Scaling(2), "pow2")
    assert version.engine.num_threads == 1 and config.deployment_names == {(0, "default"): "engine-0-default"}
    args = parse_args(["serve", "--min-replicas", "1", "--max-replicas", "3", "--ray-address", "auto"])
    config = from_flags(args, engine_config(args), None)
    assert config.models[0].versions[0].scaling.max_replicas == 3 and config.ray_address == "auto"
    with pytest.raises(ValueError):
        from_flags(parse_args(["serve", "--routing", "random"]), engine_config(args), None)
