"""A real model that thinks on cue, for the reasoning-parser tests (server and playground): a tiny
Llama whose tokenizer has ``<think>`` and ``</think>`` as added tokens and whose weights make each
token's successor a programmed one (its layers add nothing; the embedding of a programmed token
picks one row of the output head), so greedy decoding writes a known token sequence: after the
generation prompt's newline, ``<think> Use <tool_call> here</think>\\n\\nParis``. The chat template
opens the block in the prompt when ``open_thinking`` is set, closes an empty one for
``enable_thinking: false`` (as Qwen3's), and ends the prompt with ``cue`` when given (``Hello`` makes
the model answer `` world``)."""

from __future__ import annotations

from pathlib import Path

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_thinking %}<think>{% endif %}{{ cue | default('') }}{% endif %}")
# Each token's programmed successor (as tokens of the default tokenizer plus the two tags).
SUCCESSORS = ["Ċ", "<think>", "ĠUse", "Ġ<", "tool", "_", "call", ">", "Ġhere", "</think>", "ĊĊ", "Paris",
              "<|im_end|>"]
CUED = ["Hello", "Ġworld", "<|im_end|>"]
THOUGHT, ANSWER = "Use <tool_call> here", "Paris"
THOUGHT_TOKENS = 9  # <think>, six tokens of text, </think>

def program(model: object, tokenizer: object) -> None:
    """Zero every weight but the norms; then each chain's token, embedded along a dimension of its
    own, gives its successor's logit 80 and every other token's 0."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if "norm" in name else 0.0)
        pairs = [(a, b) for chain in (SUCCESSORS, CUED) for a, b in zip(chain, chain[1:])]
        for dim, (token, successor) in enumerate(pairs):
            source, target = tokenizer.convert_tokens_to_ids([token, successor])
            model.model.embed_tokens.weight[source, dim] = 1.0
            model.lm_head.weight[target, dim] = 10.0


def save_thinker(out: Path, tokenizer_dir: Path) -> Path:
    """The thinking model, saved as a Hugging Face directory ``out`` with the tokenizer of
    ``tokenizer_dir`` (plus the two tags and TEMPLATE)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = transformers.LlamaForCausalLM(config).eval()
    program(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
