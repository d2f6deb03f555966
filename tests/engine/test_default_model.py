"""The bundled SmolLM2-135M-Instruct GGUF: vivace's greedy chat answers equal transformers'."""

import pytest
import torch
import transformers

from vivace import LLM, SamplingParams

from vivace.models.loader import default_model_path

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


def test_greedy_chat_equals_transformers():
    llm = LLM("default", dtype="float32", kv_cache_memory_gb=0.25)
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                             tokenize=False) for c in CHATS]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=64)  # stops at eos, as transformers does
    ours = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
    llm.check_integrity()

    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    for ids, answer in zip(prompt_ids, ours):
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        assert answer == expected[0, len(ids):].tolist()
    assert "Paris" in tokenizer.decode(ours[0])


@pytest.mark.parametrize("quantization", [
    "int8",
    # Known defect: with int4 weights (and the kernel's int8 activations) this answer drifts to
    # "L'Étoile, la Marseur, la France, ..." although perplexity is within 0.5% of float.
    pytest.param("int4", marks=pytest.mark.xfail(reason="int4 chat answer drifts; see issue 5 note")),
])
def test_quantized_default_model_still_chats(quantization):
    llm = LLM("default", quantization=quantization, kv_cache_memory_gb=0.1)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHATS[0]}],
                                               add_generation_prompt=True, tokenize=False)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    llm.check_integrity()
