"""The bundled SmolLM2-135M-Instruct GGUF: vivace's greedy chat answers equal transformers'."""

import pytest
import torch

from vivace import LLM, SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="module")
def float_llm() -> LLM:
    """The default model with float weights: loaded once for the comparison with transformers
    and the smoke test's float row."""
    return LLM("default", dtype="float32", quantization="none", kv_cache_memory_gb=0.25)


def test_greedy_chat_equals_transformers(hf_default_model, float_llm):
    llm = float_llm
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                             tokenize=False) for c in CHATS]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=64)  # stops at eos, as transformers does
    ours = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
    llm.check_integrity()

    for ids, answer in zip(prompt_ids, ours):
        expected = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        assert answer == expected[0, len(ids):].tolist()
    assert "Paris" in tokenizer.decode(ours[0])


# Chat turns whose answer the float model states with a clear margin, the assistant's reply
# begun where the fact comes next. Free greedy answers are no test of quality here: for "What
# is the capital of France?" the float model's first token is a near-tie ("The" -1.88 vs "L"
# -1.97 nats), so any quantization may flip it; llama.cpp's Q4_1 x Q8_1 kernels answer
# "L'Étoile, la Marseillaise, ..." exactly as vivace's int4 does.
SMOKE = [
    ("What is the capital of France?", "The capital of France is", "Paris"),
    ("What is the capital of Japan?", "The capital of Japan is", "Tokyo"),
    ("Name the three primary colors.", "The primary colors are", "Yellow"),
    ("How many days are in a week?", "A week has", "7"),
    ("What is the opposite of hot?", "The opposite of hot is", "cold"),
]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_quantized_default_model_still_chats(quantization, request):
    if quantization == "none":
        llm = request.getfixturevalue("float_llm")
    else:
        llm = LLM("default", quantization=quantization, kv_cache_memory_gb=0.1)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=False) + start
               for question, start, _ in SMOKE]
    # 16 tokens: int8 weights over the float16 KV cache answer the colors as a list (":\n\nRed
    # (R)\nBlue (B)\nYellow (Y)"), whose third color is the 15th token.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for (question, _, expected), out in zip(SMOKE, outs):
        assert expected in out.outputs[0].text, (question, out.outputs[0].text)
    llm.check_integrity()
