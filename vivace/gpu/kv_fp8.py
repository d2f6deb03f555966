"""Scales of a float8 (e4m3) KV cache, ``--kv-cache-dtype fp8``: one float32 per (layer, KV head)
for the keys and one for the values, ``[2, num_kv_heads]`` per layer; a stored value is the real
one divided by its scale (``vivace.gpu.kernels`` quantizes on write, dequantizes on read).

Where they come from, first found wins:

1. The checkpoint's ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (the compressed-tensors /
   vLLM FP8 KV layout: a scalar per layer, or one per KV head), read from its safetensors files.
2. Calibration at start: one forward of ``CALIBRATION_TOKENS`` fixed token ids (BOS, then ids drawn
   from a seeded generator) into a float32 cache; each head's largest |K| and |V| there sets a
   power-of-two scale that stores it in (16, 32] (``power_of_two_scales``).

Why not vLLM's default of 1.0 for every head: a head whose values pass 448 saturates, and one
whose values are all small (values under 2^-6 fall to e4m3's subnormals) loses digits. e4m3 is a
float, so its relative error is 2^-4 over a 2^15-wide range: the scale only has to place a head's
values inside that range, with headroom. Mapping the calibrated maximum to at most 32 leaves 14x
headroom before saturation (the clamp on write keeps anything beyond finite) while values down to
1/1024 of the maximum keep their full precision. Powers of two make dividing and multiplying by
the scale exact. The same weights always get the same scales, whatever the requests.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from vivace.gpu.forward import forward, prompt_batch
from vivace.models import LoadedModel
from vivace.models.llama import kv_cache_shape
from vivace.models.loader import KV_SCALE_NAMES, safetensors_files

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
SCALE_TARGET = 32.0  # a calibrated head's largest |value| is stored in (16, 32]


def kv_scales(loaded: LoadedModel, block_size: int, max_model_len: int, device: torch.device
              ) -> list[torch.Tensor]:
    """Per layer, float32 ``[2, num_kv_heads]`` on ``device``: the checkpoint's scales when it has
    them, else calibrated (module docstring)."""
    found = checkpoint_kv_scales(loaded.source, loaded.config.num_hidden_layers, loaded.config.num_key_value_heads)
    if found is not None:
        return [scale.to(device) for scale in found]
    return calibrate_kv_scales(loaded, block_size, min(CALIBRATION_TOKENS, max_model_len), device)


def power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= SCALE_TARGET`` (1 where ``amax`` is 0)."""
    amax = amax.float()
    scales = torch.exp2(torch.ceil(torch.log2(amax / SCALE_TARGET)))
    return torch.where(amax > 0, scales, torch.ones_like(scales))


def checkpoint_kv_scales(source: Path, num_layers: int, num_kv_heads: int) -> list[torch.Tensor] | None:
    """The ``k_scale``/``v_scale`` of every layer in the safetensors files of the model directory
    ``source``, each broadcast to ``[2, num_kv_heads]`` float32 on the CPU; None when it has none.
    Raises ValueError when only some layers have them, or one is not positive and finite."""
    try:
        files = safetensors_files(source) if source.is_dir() else []
    except FileNotFoundError:  # a dummy model's directory: its config.json, no weights
        files = []
    found: dict[tuple[int, int], torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                key = _scale_key(name)
                if key is not None:
                    found[key] = reader.get_tensor(name).float().reshape(-1)
    if not found:
        return None
    scales = []
    for layer in range(num_layers):
        missing = [KV_SCALE_NAMES[kv] for kv in (0, 1) if (layer, kv) not in found]
        if missing:
            raise ValueError(f"{source}: layer {layer} lacks {', '.join(missing)} while other layers have "
                             "FP8 KV scales")
        if any(found[layer, kv].numel() not in (1, num_kv_heads) for kv in (0, 1)):
            raise ValueError(f"{source}: layer {layer}'s KV scales must be one number or one per KV head "
                             f"({num_kv_heads})")
        scale = torch.stack([found[layer, kv].expand(num_kv_heads) for kv in (0, 1)])
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"{source}: layer {layer}'s KV scales must be positive and finite, got {scale.tolist()}")
        scales.append(scale.contiguous())
    return scales


def _scale_key(name: str) -> tuple[int, int] | None:
    """``(layer, 0 keys / 1 values)`` of a checkpoint tensor named ``...layers.N.self_attn.k_scale``
    (or ``v_scale``), else None."""
    parts = name.split(".")
    for kv, suffix in enumerate(KV_SCALE_NAMES):
        if name.endswith("." + suffix) and "layers" in parts[:-3]:
            return int(parts[parts.index("layers") + 1]), kv
    return None


@torch.inference_mode()
def calibrate_kv_scales(loaded: LoadedModel, block_size: int, num_tokens: int, device: torch.device
                        ) -> list[torch.Tensor]:
    """Scales from one forward of ``num_tokens`` fixed token ids (module docstring), its K/V written
    to a float32 cache; deterministic for given weights."""
    config = loaded.config
    ids = torch.randint(config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(CALIBRATION_SEED))
    if config.bos_token_id is not None:
        ids[0] = config.bos_token_id
    num_blocks = -(-num_tokens // block_size)
    caches = [torch.zeros(kv_cache_shape(config, num_blocks, block_size), device=device)
              for _ in range(config.num_hidden_layers)]
    forward(loaded.model, prompt_batch(ids.to(device), block_size), caches)
    # [2, blocks, block_size, heads, head_dim] -> [2, heads]; unwritten slots hold zeros
    return [power_of_two_scales(cache.abs().amax(dim=(1, 2, 4))) for cache in caches]

