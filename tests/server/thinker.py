"""A real model that thinks on cue, for the reasoning-parser tests (server and playground): a
programmed tiny Llama (``programmed.py``) whose tokenizer has ``<think>`` and ``</think>`` as added
tokens, so greedy decoding writes a known token sequence: after the generation prompt's newline, ``<think> Use <tool_call> here</think>\\n\\nParis``. The chat template
opens the block in the prompt when ``open_thinking`` is set, closes an empty one for
``enable_thinking: false`` (as Qwen3's), and ends the prompt with ``cue`` when given (``Hello`` makes
the model answer `` world``)."""

from __future__ import annotations

from pathlib import Path

from .programmed import save_programmed

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


def save_thinker(out: Path, tokenizer_dir: Path) -> Path:
    """The thinking model, saved as a Hugging Face directory ``out`` with the tokenizer of
    ``tokenizer_dir`` (plus the two tags and TEMPLATE)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    return save_programmed(out, tokenizer, [SUCCESSORS, CUED])
