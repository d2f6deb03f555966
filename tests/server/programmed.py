"""Real models whose greedy output is known: a tiny Llama whose layers add nothing and whose
embedding of a programmed token picks one row of the output head, so each token's successor is a
programmed one. The thinking model (``thinker.py``) and the tool callers (``test_tool_formats_served.py``)
are made this way."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import transformers


def program(model: Any, tokenizer: Any, chains: Sequence[Sequence[str]]) -> None:
    """Zero every weight but the norms; then each chain's token, embedded along a dimension of its
    own, gives its successor's logit 80 and every other token's 0."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if "norm" in name else 0.0)
        pairs = [(a, b) for chain in chains for a, b in zip(chain, chain[1:])]
        assert len({a for a, _ in pairs}) == len(pairs), "a token has one successor"
        for dim, (token, successor) in enumerate(pairs):
            source, target = tokenizer.convert_tokens_to_ids([token, successor])
            model.model.embed_tokens.weight[source, dim] = 1.0
            model.lm_head.weight[target, dim] = 10.0


def save_programmed(out: Path, tokenizer: Any, chains: Sequence[Sequence[str]]) -> Path:
    """A programmed model for ``tokenizer`` (its vocabulary, special tokens and chat template as
    given), saved as a Hugging Face directory ``out``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = transformers.LlamaForCausalLM(config).eval()
    program(model, tokenizer, chains)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def distinct_tokens(tokenizer: Any, text: str, taken: set[str]) -> list[str]:
    """``text`` as tokens none of which repeats or is in ``taken``, so each can have a successor of
    its own: at each place the longest vocabulary token still free, else a piece one character
    longer than the longest, added to the tokenizer (JSON repeats its quotes and colons)."""
    tokens: list[str] = []
    used = set(taken)
    start = 0
    while start < len(text):
        pieces = [text[start:end] for end in range(len(text), start, -1)]
        fits = [p for p in pieces if len(tokenizer.encode(p, add_special_tokens=False)) == 1]
        free = [tokenizer.convert_ids_to_tokens(tokenizer.encode(p, add_special_tokens=False))[0] for p in fits]
        chosen = next(((t, len(p)) for t, p in zip(free, fits) if t not in used), None)
        if chosen is None:
            piece = text[start:start + len(fits[0]) + 1]
            tokenizer.add_tokens([transformers.AddedToken(piece, normalized=False)])
            chosen = (piece, len(piece))
        tokens.append(chosen[0])
        used.add(chosen[0])
        start += chosen[1]
    return tokens
