"""vivace's Llama-family model against transformers, through the paged cache: full prefill,
prefill then one-token decodes, and two sequences mixed in one flat batch."""

from __future__ import annotations

import pytest
import torch

from vivace.models import load_model
from vivace.models.llama import kv_bytes_per_token, kv_cache_shape

from .tiny import KINDS, PagedRun, hf_logits, prompt

ATOL = 1e-4


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= ATOL


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_transformers(tiny, kind: str) -> None:
    model = tiny(kind)
    loaded = load_model(str(model.path), torch.float32)
    ids = prompt(23, seed=1)
    logits = PagedRun(loaded.model, loaded.config).step({"a": ids})["a"]
    assert_close(logits, hf_logits(model.hf, ids))


@pytest.mark.parametrize("kind", KINDS)
def test_decode_after_prefill_matches_transformers(tiny, kind: str) -> None:
    model = tiny(kind)
    loaded = load_model(str(model.path), torch.float32)
    ids = prompt(14, seed=2)
    expected = hf_logits(model.hf, ids)
    run = PagedRun(loaded.model, loaded.config)
    assert_close(run.step({"a": ids[:5]})["a"], expected[:5])
    for pos in range(5, len(ids)):
        assert_close(run.step({"a": [ids[pos]]})["a"], expected[pos:pos + 1])


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_matches_transformers(tiny, kind: str) -> None:
    model = tiny(kind)
    loaded = load_model(str(model.path), torch.float32)
    a, b = prompt(13, seed=3), prompt(9, seed=4)
    expected = {"a": hf_logits(model.hf, a), "b": hf_logits(model.hf, b)}
    run = PagedRun(loaded.model, loaded.config)
    # a prefills, then decodes while b prefills in chunks, then both decode together.
    schedule = [{"a": a[:6]}, {"a": a[6:7], "b": b[:3]}, {"b": b[3:7], "a": a[7:8]}]
    schedule += [{"a": [a[8]], "b": [b[7]]}, {"b": [b[8]], "a": [a[9]]}] + [{"a": [a[p]]} for p in range(10, 13)]
    done = {"a": 0, "b": 0}
    for chunks in schedule:
        for seq, logits in run.step(chunks).items():
            assert_close(logits, expected[seq][done[seq]:done[seq] + len(chunks[seq])])
            done[seq] += len(chunks[seq])
    assert done == {"a": len(a), "b": len(b)}


def test_kv_cache_geometry(tiny) -> None:
    config = load_model(str(tiny("mistral").path), torch.float32).config
    assert kv_cache_shape(config, num_blocks=10, block_size=4) == (2, 10, 4, 2, 32)
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 32 * 2


def test_bfloat16_tracks_float32(tiny) -> None:
    model = tiny("llama")
    loaded = load_model(str(model.path), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    ids = prompt(12, seed=5)
    logits = PagedRun(loaded.model, loaded.config).step({"a": ids})["a"]
    expected = hf_logits(model.hf, ids)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max().item() < 0.1 * expected.abs().max().item()
