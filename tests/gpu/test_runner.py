"""The CUDA runner behind the engine seam, end to end: greedy tokens of tiny random Llama, Qwen3,
Gemma 3, Phi-3 (partial rotary, LongRoPE) and Granite models equal transformers' and the CPU runner's,
through whole-prompt and chunked prefill, prefix-cache hits, mixed batches and n-gram verification
rows; a prompt's logits equal transformers'; tokens drawn by the device sampler (penalties,
logprobs, seeds) match the CPU engine's host sampler or reproduce across runs and batches (on CPU
under Triton's interpreter where there is no GPU: few tokens, tiny models)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace import LLM, SamplingParams  # noqa: E402
from vivace.gpu import kernels  # noqa: E402
from vivace.gpu.forward import GpuBatch, forward  # noqa: E402
from vivace.gpu.runner import CudaRunner, PrefillGraphs, graph_buckets, prefill_buckets  # noqa: E402
from vivace.models import load_model  # noqa: E402
from tests.models.tiny import PHI3_LONGROPE, save_hf_dir, tiny_model  # noqa: E402

from .conftest import DEVICE  # noqa: E402

PROMPTS = [[5, 90, 31, 242, 77, 12, 5, 90, 31, 242, 77, 12, 5, 90], [8, 100, 200, 7]]  # ids every vocab has
NEW = 6
# What sets each family's forward apart: Qwen3's per-head q/k norms; Gemma 3's (1 + w) and sandwich
# norms, scaled embeddings, GELU MLP, sliding layers (window 6) with their own rope base, a query
# scale apart from head_dim, and final logit soft-capping.
# Phi-4-mini's partial rotary (12 of 16 dims) with LongRoPE's short factors (served within the
# original context) and an attention factor. Granite's four multipliers (tiny.GRANITE).
FAMILIES = {"qwen3": ("qwen3", {}), "gemma3": ("gemma3_pattern2", dict(final_logit_softcapping=2.0)),
            "phi3": ("phi3", dict(PHI3_LONGROPE, original_max_position_embeddings=128,
                                  rope_scaling=dict(PHI3_LONGROPE["rope_scaling"], attention_factor=1.25))),
            "granite": ("granite", {})}


def greedy(**params: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **params)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=seed, max_tokens=NEW, ignore_eos=True,
                          logprobs=2)


def with_cuda_runner(llm: LLM, model_dir: str, kv_dtype: torch.dtype = torch.float32) -> LLM:
    """``llm`` with its runner replaced by a CudaRunner on DEVICE over a fresh copy of the weights
    (the CPU engine repacks its own for the native GEMM), its KV cache in ``kv_dtype``."""
    engine = llm.engine
    loaded = load_model(model_dir, torch.float32, device=DEVICE)
    engine.runner = CudaRunner(loaded, len(engine.kv.blocks), engine.kv.block_size, kv_dtype,
                               engine.max_model_len, device=DEVICE)
    return llm


@pytest.fixture(scope="module", params=["llama", *FAMILIES])
def family(request, tiny_model_dir, tmp_path_factory):
    """``(directory, transformers model)`` of a tiny random model of each family."""
    import transformers

    if request.param == "llama":
        return str(tiny_model_dir), transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32).eval()
    kind, overrides = FAMILIES[request.param]
    hf = tiny_model(kind, **overrides)
    return str(save_hf_dir(hf, tmp_path_factory.mktemp(request.param))), hf


def test_greedy_equals_transformers_and_the_cpu_runner(family, request) -> None:
    if DEVICE != "cuda" and request.node.callspec.params["family"] == "granite":
        pytest.skip("on CPU, Granite's forward is checked by its prompt logits (the interpreter's time)")
    path, hf = family
    # A 5-token budget: the 14-token prompt prefills in chunks, riding with the other's decodes.
    config = dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=5, max_model_len=64, device="cpu")
    gpu = with_cuda_runner(LLM(path, **config), path)
    ours = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, greedy())]
    for prompt, tokens in zip(PROMPTS, ours):
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert tokens == theirs[0, len(prompt):].tolist()
    cpu = LLM(path, **config)
    assert [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy())] == ours
    assert gpu.engine.runner.sampler.num_steps > NEW  # the device sampler drew them
    # Penalties and logprobs on the device, against the CPU engine's host sampler.
    params = greedy(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logprobs=3)
    theirs = cpu.generate(PROMPTS[0], params)[0].outputs[0]
    mine = gpu.generate(PROMPTS[0], params)[0].outputs[0]
    assert mine.token_ids == theirs.token_ids
    for a, b in zip(mine.logprobs, theirs.logprobs):
        assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
        assert abs(a.logprob - b.logprob) < 2e-3  # the two forwards differ by float rounding
    # Again: the prompts' full blocks now come from the prefix cache.
    again = gpu.generate(PROMPTS[0], greedy())[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == ours[0]
    gpu.engine.check_integrity()
    assert gpu.engine.kv.num_free_blocks == 32


@torch.inference_mode()
def test_prompt_logits_equal_transformers(family) -> None:
    """Logits themselves, not only their argmax (soft-capping keeps the argmax)."""
    path, hf = family
    loaded = load_model(path, torch.float32, device=DEVICE)
    prompt = PROMPTS[0]
    n, block_size = len(prompt), 4
    caches = [torch.zeros(2, 5, block_size, loaded.config.num_key_value_heads, loaded.config.head_dim,
                          device=DEVICE) for _ in range(loaded.config.num_hidden_layers)]

    def tensor(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    # Blocks out of order: the sequence's block table is 3, 0, 4, 1.
    table = [3, 0, 4, 1]
    batch = GpuBatch(tensor(prompt), tensor(list(range(n))), tensor([table[p // block_size] * block_size
                                                                      + p % block_size for p in range(n)]),
                     tensor([table], torch.int32), tensor([n], torch.int32), tensor([0, n], torch.int32), n)
    logits = loaded.model.compute_logits(forward(loaded.model, batch, caches)).cpu()
    want = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)


def test_prompt_step_graphs_keep_greedy_tokens(tiny_model_dir, monkeypatch) -> None:
    """Steps that carry prompt tokens replay the prefill graphs (eager stand-ins on CPU): whole
    prompts, 5-token chunks beside decode rows (those through the decode kernel), prefix-cache
    hits, padded to the bucket; a step of more sequences than the graphs hold runs eagerly. The
    tokens are the CPU runner's."""
    config = dict(num_kv_blocks=48, block_size=4, max_num_batched_tokens=5, max_model_len=64, device="cpu")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][3:]]
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir), **config).generate(prompts, greedy())]
    llm = LLM(str(tiny_model_dir), **config)
    engine = llm.engine
    engine.runner = CudaRunner(load_model(str(tiny_model_dir), torch.float32, device=DEVICE), len(engine.kv.blocks),
                               engine.kv.block_size, torch.float32, engine.max_model_len, device=DEVICE,
                               cuda_graph_max_batch=2, prefill_graph_tokens=5)
    graphs = engine.runner.prefill_graphs
    assert graphs.buckets == [8] and graphs.max_seqs == 2
    replayed: list[int] = []
    replay = PrefillGraphs.replay
    monkeypatch.setattr(PrefillGraphs, "replay",
                        lambda self, host, rows: (replayed.append(len(host.seq_lens)), replay(self, host, rows))[1])
    decode_rows: list[bool] = []  # per decode attention launch: whether a prompt step's
    attention = kernels.paged_decode_attention
    monkeypatch.setattr(kernels, "paged_decode_attention",
                        lambda *args, **kw: (decode_rows.append("query_start" in kw), attention(*args, **kw))[1])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())] == plain
    assert 2 in replayed  # chunks beside a decode row (steps of 3 sequences ran eagerly)
    assert graphs.decode_row_splits >= 1 and any(decode_rows)
    again = llm.generate(prompts[0], greedy())[0]  # a prompt alone, after a prefix-cache hit
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == plain[0] and replayed[-1] == 1
    engine.check_integrity()


def test_prompt_logprobs_equal_the_cpu_engine(tiny_model_dir, monkeypatch) -> None:
    """Prompt logprobs from the CUDA runner's rows: chunks beside decode rows (more rows than the
    prompt-step graphs hold: eager), and a short prompt whose rows a graph replays; the tokens are
    drawn on the host for those steps and equal the CPU engine's, as do the logprobs."""
    config = dict(num_kv_blocks=48, block_size=4, max_num_batched_tokens=5, max_model_len=64, device="cpu",
                  kv_cache_dtype="float32")
    params = greedy(prompt_logprobs=2)
    prompts = [PROMPTS[0], PROMPTS[1]]
    cpu = LLM(str(tiny_model_dir), **config)
    want = cpu.generate(prompts + [[8, 100]], params)
    llm = LLM(str(tiny_model_dir), **config)
    engine = llm.engine
    engine.runner = CudaRunner(load_model(str(tiny_model_dir), torch.float32, device=DEVICE), len(engine.kv.blocks),
                               engine.kv.block_size, torch.float32, engine.max_model_len, device=DEVICE,
                               cuda_graph_max_batch=2, prefill_graph_tokens=5)
    replayed: list[list[int]] = []
    replay = PrefillGraphs.replay
    monkeypatch.setattr(PrefillGraphs, "replay", lambda self, host, rows: (replayed.append(rows), replay(self, host, rows))[1])
    got = llm.generate(prompts, params) + llm.generate([8, 100], params)  # 1 prompt row and 1 sampling row
    assert replayed[-1] == [0, 1]
    for mine, theirs in zip(got, want):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert mine.prompt_logprobs[0] is None and len(mine.prompt_logprobs) == len(theirs.prompt_logprobs)
        for a, b in zip(mine.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 2e-3  # float rounding apart
            assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
    engine.check_integrity()
    assert engine.kv.num_free_blocks == 48


def test_prefill_buckets() -> None:
    assert prefill_buckets(5) == [8]
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(300) == [16, 32, 64, 128, 256, 512]


def test_ngram_verification_rows_keep_greedy_tokens(tiny_model_dir) -> None:
    config = dict(num_kv_blocks=32, block_size=4, max_model_len=64, device="cpu")
    plain = LLM(str(tiny_model_dir), **config).generate(PROMPTS[0], greedy())[0].outputs[0].token_ids
    spec = with_cuda_runner(LLM(str(tiny_model_dir), speculative="ngram", num_speculative_tokens=2, **config),
                            str(tiny_model_dir))
    assert spec.generate(PROMPTS[0], greedy())[0].outputs[0].token_ids == plain
    assert spec.engine.spec_stats.num_steps > 0


def test_verification_graphs_keep_greedy_tokens(tiny_model_dir) -> None:
    """n-gram proposals verified by graphs of (sequences, proposals) buckets (eager stand-ins on
    CPU): the tokens of plain greedy decoding, and the graphs did replay."""
    config = dict(num_kv_blocks=32, block_size=4, max_model_len=64, device="cpu")
    prompts = [PROMPTS[0], PROMPTS[0][2:]]
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir), **config).generate(prompts, greedy())]
    spec = LLM(str(tiny_model_dir), speculative="ngram", num_speculative_tokens=2, **config)
    loaded = load_model(str(tiny_model_dir), torch.float32, device=DEVICE)
    runner = spec.engine.runner = CudaRunner(loaded, 32, 4, torch.float32, 64, device=DEVICE,
                                             cuda_graph_max_batch=2, verify_batch=2, verify_tokens=2)
    replayed = []
    replay_verify = runner.graphs.replay_verify
    runner.graphs.replay_verify = lambda rows, *rest: replayed.append(len(rows)) or replay_verify(rows, *rest)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy())] == plain
    assert replayed and spec.engine.spec_stats.num_steps > 0


def test_seeded_device_sampling_reproduces_across_runs_and_batches(tiny_model_dir) -> None:
    config = dict(num_kv_blocks=32, block_size=4, max_model_len=64, device="cpu")
    gpu = with_cuda_runner(LLM(str(tiny_model_dir), **config), str(tiny_model_dir))
    alone = gpu.generate(PROMPTS[0], seeded(5))[0].outputs[0]
    assert len(alone.logprobs) == NEW and all(len(lp.top) == 2 for lp in alone.logprobs)
    assert gpu.generate(PROMPTS[0], seeded(5))[0].outputs[0].token_ids == alone.token_ids
    others = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    batched = gpu.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1]], [others, seeded(5), greedy()])
    assert batched[1].outputs[0].token_ids == alone.token_ids
    assert gpu.generate(PROMPTS[0], seeded(6))[0].outputs[0].token_ids != alone.token_ids
    gpu.engine.check_integrity()


def test_graph_buckets() -> None:
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]


def test_graph_replay_equals_eager_across_buckets(family, request) -> None:
    """CUDA graphs on a GPU; on CPU their eager stand-ins, so the static buffers, bucket padding,
    sampler plans and decode steps queued ahead (their ids on the device) are checked there too
    (on the Llama family: the interpreter takes a minute for all three)."""
    if DEVICE != "cuda" and request.node.callspec.params["family"] != "llama":
        pytest.skip("on CPU, graph stand-ins run on the Llama family only")
    path, _ = family
    config = dict(num_kv_blocks=64, block_size=16, max_model_len=128, device="cpu")
    # Every sampler plan inside the graphs: seeds, filters, penalties, bans, logprobs (on CPU the
    # first four, in buckets of up to 4, to keep the interpreter's time down).
    mixed = [seeded(3), greedy(repetition_penalty=1.2, logprobs=2),
             SamplingParams(temperature=0.7, min_p=0.1, seed=9, min_tokens=NEW, max_tokens=NEW), greedy(logprobs=0),
             greedy(), seeded(4)]
    count, max_batch = (6, 8) if DEVICE == "cuda" else (4, 4)
    prompts, mixed = (PROMPTS * 3)[:count], mixed[:count]
    eager = with_cuda_runner(LLM(path, **config), path)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy())]
    want_mixed = [o.outputs[0] for o in eager.generate(prompts, mixed)]
    graphed = LLM(path, **config)
    loaded = load_model(path, torch.float32, device=DEVICE)
    graphed.engine.runner = CudaRunner(loaded, 64, 16, torch.float32, 128, device=DEVICE,
                                       cuda_graph_max_batch=max_batch)
    graphs, replayed = graphed.engine.runner.graphs, []
    replay = graphs.replay
    graphs.replay = lambda ids, *rest: replayed.append(type(ids)) or replay(ids, *rest)
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, greedy())] == want
    got_mixed = [o.outputs[0] for o in graphed.generate(prompts, mixed)]
    assert [o.token_ids for o in got_mixed] == [o.token_ids for o in want_mixed]
    for ours, theirs in zip(got_mixed, want_mixed):
        for a, b in zip(ours.logprobs or [], theirs.logprobs or [], strict=True):
            assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top] and abs(a.logprob - b.logprob) < 1e-3
    assert list in replayed and torch.Tensor in replayed  # graphs replayed, with ids from the host and the device


def test_batch1_gemv_in_the_forward_keeps_greedy_tokens(family, request) -> None:
    """The Triton GEMV (down projection with its activation fused) in every batch-1 projection,
    as ``choose_gemv`` sets it where it beats cuBLAS: the same greedy tokens as the CPU runner
    (on CPU for SiLU and GELU: Llama and Gemma 3)."""
    if DEVICE != "cuda" and request.node.callspec.params["family"] in ("qwen3", "phi3", "granite"):
        pytest.skip("Qwen3's, Phi-3's and Granite's MLPs are Llama's")
    path, _ = family
    config = dict(num_kv_blocks=32, block_size=4, max_model_len=64, device="cpu")
    want = LLM(path, **config).generate(PROMPTS[1], greedy())[0].outputs[0].token_ids
    gpu = with_cuda_runner(LLM(path, **config), path)
    for layer in gpu.engine.runner.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            module.gemv_block, module.gemv_splits = 4, 2
        layer.mlp.down_proj.gated_gemv_block, layer.mlp.down_proj.gated_gemv_splits = 8, 2
    calls, folded = [], set()
    gemv = kernels.gemv

    def recording(*args, **kwargs):
        calls.append(args[3] if len(args) > 3 else None)
        folded.update(key for key in ("norm_weight", "residual") if kwargs.get(key) is not None)
        return gemv(*args, **kwargs)

    kernels.gemv = recording
    try:
        assert gpu.generate(PROMPTS[1], greedy())[0].outputs[0].token_ids == want
    finally:
        kernels.gemv = gemv
    assert None in calls and ("silu" in calls or "gelu" in calls)
    # the norms fold into the GEMVs (forward.FOLD_NORMS): Llama's both ways, Gemma's input norm only
    gemma = request.node.callspec.params["family"] == "gemma3"
    assert folded == ({"norm_weight"} if gemma else {"norm_weight", "residual"})
