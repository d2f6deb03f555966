"""The CUDA backend on random weights at real shapes (bf16): batch-1 decode against the HBM floor
and Hugging Face transformers, batched decode against the (weights + KV) floor, and prefill; then
the same model with its projections in GGUF formats (kept as blocks, ``vivace.gpu.gguf_linear``)
and in FP8 (``vivace.gpu.fp8_linear``).

    python benchmarks/gpu.py [--presets smollm2-135m,llama-3.2-1b,llama-3.1-8b] [--context 512]
                             [--batches 8,32,64] [--prompts 128,512,2048] [--no-hf | --hf-presets P,...]
                             [--gguf-types Q8_0,Q4_0,Q4_K] [--gguf-batches ""]
                             [--fp8] [--fp8-batches 64] [--no-engine] [--tokenizer DIR] [--out FILE.json]
                             [--kv-dtypes bfloat16,fp8 [--kv-contexts 512,4096] [--kv-batches 64] [--kv-only]]

Needs a GPU (exits 2 without one). Per preset: the HBM floor (bytes one step reads / the copy
bandwidth measured in this run), vivace's decode step (a CUDA graph replay, median of 200; and
the same with the host's input staging and the logits' copy back, as the engine's host-sampler
path steps; and with the device sampler's graph instead, greedy and top-p, tokens back), HF's
static-cache + torch.compile decode in this run (its ITL: the difference of two generate calls'
times over the difference of their tokens), the engine loop's batch-1 ITL (``LLMEngine.step``
with the device sampler, detokenization and stop checks; with the overlap scheduler and without),
batch 8/32/64 steps, and prompt prefill times (eager forward + LM head of the last token, median
of 5). Per GGUF type (random blocks in every
projection and the LM head, tied or not; embedding and norms bf16; ``Q4_K_M``: llama-quantize's
mix, ``gguf_linear.randomize_packed``): the floor of its packed bytes,
the batch-1 step (and ``--gguf-batches``) and the prefill times; and per type at the 8B shape's
matrices, the GGUF kernel's batch-1 GEMV (packed TB/s) and 512-row GEMM (TFLOP/s) beside cuBLAS
on bf16. With ``--fp8``, the same for FP8 projections (e4m3 quantized at load from the random
bf16 weights; the LM head stays bf16): batch 1 and ``--fp8-batches``; its matrix rows are the FP8
GEMV and ``torch._scaled_mm`` with per-token activation scales (the quantization included).
With ``--kv-dtypes``, per preset: the decode step of many streams (``--kv-batches``) at
each of ``--kv-contexts`` with the KV cache in each dtype (``fp8``: float8 e4m3, one byte a value),
tokens/s and the ratio to the first dtype; ``--kv-only`` runs only these. For every preset and
format, the batch-1 graph is also captured and timed under each launch variant (norms and rotary
folded into the GEMVs and the decode attention or launched on their own, programmatic dependent
launch off or on, and the Triton GEMV on every float projection where ``choose_gemv`` kept cuBLAS:
``launch_variants``); and the kernels of its batch-1 and largest-batch graphs as the CUDA profiler
sees them (``kernel_profile``: each kernel's median time in launch order, grouped by name in the
printout). Prints a table per
preset; with ``--out``, also writes every figure as JSON. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

import gguf
import numpy as np
import torch

from vivace.models.dummy import PRESETS

DTYPE = torch.bfloat16


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth, bytes/s, read + write counted (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def timed(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (synchronized on both ends)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_profile(replay, repeats: int = 20) -> dict:
    """The kernels of ``repeats`` calls of ``replay`` (a graph's replay) as the CUDA profiler saw
    them: per kernel of one call, in launch order, its name, grid and median duration (us); the
    call's span (first kernel's start to last kernel's end, median) and the durations' sum (a sum
    above the span: kernels overlapping, as under PDL; below it: the GPU idle between kernels)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_call, left = divmod(len(kernels), repeats)
    if not kernels or left:
        return {"error": f"{len(kernels)} kernel events for {repeats} calls"}
    calls = [kernels[i * per_call:(i + 1) * per_call] for i in range(repeats)]
    rows = [{"name": k["name"], "grid": k.get("args", {}).get("grid"),
             "us": statistics.median(call[j]["dur"] for call in calls)} for j, k in enumerate(calls[0])]
    span = statistics.median(call[-1]["ts"] + call[-1]["dur"] - call[0]["ts"] for call in calls)
    return {"kernels": rows, "span_us": span, "sum_us": sum(r["us"] for r in rows)}


def print_kernel_profile(label: str, profile: dict, top: int = 12) -> None:
    """The profile's kernels grouped by name, the most time first."""
    if "error" in profile:
        print(f"{label}: kernel profile failed: {profile['error']}", flush=True)
        return
    groups: dict[str, list[float]] = {}
    for row in profile["kernels"]:
        groups.setdefault(row["name"], []).append(row["us"])
    print(f"\n{label}: {len(profile['kernels'])} kernels a step, span {profile['span_us']:.1f} us, "
          f"durations' sum {profile['sum_us']:.1f} us\n\n| kernel | launches a step | us a step | share of the sum |"
          "\n|---|---|---|---|")
    for name, times in sorted(groups.items(), key=lambda item: -sum(item[1]))[:top]:
        print(f"| {name[:90]} | {len(times)} | {sum(times):.1f} | {sum(times) / profile['sum_us']:.0%} |")
    sys.stdout.flush()


def bytes_read_per_step(loaded, batch: int, context: int, kv_dtype: torch.dtype = DTYPE) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads: every weight (GGUF blocks as packed, FP8
    codes and scales) but the embedding table (one row a token), unless it doubles as the LM head;
    every cached token of each sequence."""
    from vivace.models.llama import kv_bytes_per_token
    from vivace.models.loader import module_weight_bytes

    model = loaded.model
    weights = module_weight_bytes(model)
    if model.lm_head is not None:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return weights, batch * context * kv_bytes_per_token(loaded.config, kv_dtype)


def kv_dtype_rows(preset: str, kv_dtype: str, contexts: list[int], batches: list[int],
                  tokenizer: str | None = None) -> dict:
    """Decode steps (graph replay, median of 50) of ``preset`` in bf16 with its KV cache in
    ``kv_dtype`` (a ``--kv-cache-dtype`` name), every sequence ``context`` tokens long, for each
    context and batch: milliseconds, tokens/s and the bytes the step reads."""
    from vivace.config import EngineConfig
    from vivace.gpu.runner import CudaRunner
    from vivace.models import load_model

    torch_kv = EngineConfig(dtype="bfloat16", kv_cache_dtype=kv_dtype, device="cuda").kv_torch_dtype
    loaded = load_model(preset, DTYPE, load_format="dummy", device="cuda", tokenizer=tokenizer)
    block_size, max_batch, max_len = 16, max(batches), max(contexts) + 1
    per_seq = -(-max_len // block_size)
    runner = CudaRunner(loaded, max_batch * per_seq, block_size, torch_kv, max_len, device="cuda",
                        cuda_graph_max_batch=max_batch)
    result: dict = {"preset": preset, "kv_dtype": kv_dtype, "steps": []}
    for context in contexts:
        for batch in batches:
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
            runner.graphs.replay([1] * batch, [context] * batch, tables)  # stage the inputs once
            graph, _ = runner.graphs.graphs[next(s for s in runner.graphs.buckets if s >= batch)]
            replay = timed(graph.replay, 50)
            weights, kv = bytes_read_per_step(loaded, batch, context, torch_kv)
            result["steps"].append({"context": context, "batch": batch, "replay_ms": replay * 1e3,
                                    "tokens_per_s": batch / replay, "weight_bytes": weights, "kv_bytes": kv})
    del runner, loaded
    torch.cuda.empty_cache()
    return result


def print_kv_dtype_rows(preset: str, rows: list[dict], bandwidth: float) -> None:
    """One table per preset: each KV dtype's decode steps, tokens/s and their ratio to the first dtype's."""
    print(f"\n## {preset}, bf16 weights, KV cache dtypes\n")
    print("| KV cache | context | streams | KV bytes | floor (weights + KV) | graph replay | tokens/s | vs first |")
    print("|---|---|---|---|---|---|---|---|")
    first = {(d["context"], d["batch"]): d["tokens_per_s"] for d in rows[0]["steps"]} if rows else {}
    for row in rows:
        for d in row["steps"]:
            d["floor_ms"] = (d["weight_bytes"] + d["kv_bytes"]) / bandwidth * 1e3
            ratio = d["tokens_per_s"] / first[d["context"], d["batch"]]
            print(f"| {row['kv_dtype']} | {d['context']} | {d['batch']} | {d['kv_bytes'] / 1e9:.2f} GB | "
                  f"{d['floor_ms']:.3f} ms | {d['replay_ms']:.3f} ms | {d['tokens_per_s']:.0f} | {ratio:.2f}x |")
    sys.stdout.flush()


def vivace_rows(preset: str, context: int, batches: list[int], prompts: list[int],
                weight_format: str | None = None, tokenizer: str | None = None) -> dict:
    """Decode steps and prefill times of ``preset`` in bf16, or with its projections random blocks
    of a GGUF type (``weight_format``, e.g. "Q4_K") or in FP8 (``weight_format`` "fp8")."""
    from vivace.gpu.forward import forward, prompt_batch
    from vivace.engine.request import Request
    from vivace.engine.sampling_params import SamplingParams
    from vivace.gpu.gguf_linear import randomize_packed
    from vivace.gpu.runner import PREFILL_GRAPH_MAX_TOKENS, CudaRunner, HostBatch
    from vivace.models import load_model

    fp8 = weight_format == "fp8"
    loaded = load_model(preset, DTYPE, "fp8" if fp8 else "none", load_format="dummy", device="cuda",
                        tokenizer=tokenizer)
    if weight_format is not None and not fp8:
        randomize_packed(loaded.model, weight_format)
        torch.cuda.empty_cache()
    block_size = 16
    max_batch = max([1, *batches])
    max_len = max(context + 1, *prompts)
    per_seq = -(-max_len // block_size)
    num_blocks = max(max_batch * per_seq, per_seq)
    runner = CudaRunner(loaded, num_blocks, block_size, DTYPE, max_len, device="cuda",
                        cuda_graph_max_batch=max_batch, prefill_graph_tokens=PREFILL_GRAPH_MAX_TOKENS)
    graphs = runner.graphs
    for name, choice in runner.gemv_choices.items():
        print(f"{preset} {weight_format or 'bf16'}: batch-1 {name}: default {choice.default_us:.1f} us, best candidate "
              f"{choice.best_us:.1f} us -> {choice.kept}", flush=True)
    result: dict = {"preset": preset, "format": weight_format or "bf16", "context": context, "decode": {},
                    "gemv_choices": {name: vars(choice) for name, choice in runner.gemv_choices.items()},
                    "prefill_ms": {}, "prefill_graph_ms": {}}

    for batch in sorted({1, *batches}):
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        ids, positions = [1] * batch, [context] * batch
        graphs.replay(ids, positions, tables)  # stage the inputs once; then replay alone
        size = next(s for s in graphs.buckets if s >= batch)
        graph, _ = graphs.graphs[size]
        replay = timed(graph.replay, 200)
        staged = timed(lambda: graphs.replay(ids, positions, tables)[:batch].float().cpu(), 100)
        sampled = {}
        for name, params in (("greedy", dict(temperature=0)), ("top_p", dict(temperature=0.8, top_p=0.95))):
            rows = [Request(f"{name}{i}", [1] * context, SamplingParams(**params, seed=i)) for i in range(batch)]
            sampled[name] = timed(lambda: runner.sampler.read(graphs.replay_sampled(ids, positions, tables, rows),
                                                              list(range(batch)), rows), 100)
        weights, kv = bytes_read_per_step(loaded, batch, context)
        result["decode"][batch] = {"replay_ms": replay * 1e3, "step_ms": staged * 1e3,
                                   "sampled_greedy_ms": sampled["greedy"] * 1e3,
                                   "sampled_top_p_ms": sampled["top_p"] * 1e3,
                                   "weight_bytes": weights, "kv_bytes": kv}

    for length in prompts:
        batch = prompt_batch(torch.ones(length, dtype=torch.long, device="cuda"), block_size)

        def prefill() -> None:
            hidden = forward(loaded.model, batch, runner.kv_caches, runner.kv_scales)
            loaded.model.compute_logits(hidden[-1:])

        result["prefill_ms"][length] = timed(prefill, 5) * 1e3
        prompt_graphs = runner.prefill_graphs
        if prompt_graphs is not None and length <= prompt_graphs.max_tokens:
            # The runner's path for a prompt step: staging into the graph's buffers, then its replay.
            positions = np.arange(length, dtype=np.int64)
            host = HostBatch(np.ones(length, dtype=np.int64), positions, positions.copy(),
                             np.arange(-(-length // block_size), dtype=np.int32)[None, :],
                             np.array([length], dtype=np.int32), np.array([0, length], dtype=np.int32))
            result["prefill_graph_ms"][length] = timed(lambda: prompt_graphs.replay(host, [length - 1]), 10) * 1e3
    # last: a variant whose capture fails should not cost the figures above
    result["batch1_variants"] = launch_variants(runner, per_seq, context)
    for name, ms in result["batch1_variants"].items():
        print(f"{preset} {weight_format or 'bf16'}: batch-1 graph replay, {name}: "
              f"{ms if isinstance(ms, str) else f'{ms:.3f} ms'}", flush=True)
    # after every timing (the profiler's tracing may linger): the kernels of two decode graphs
    for batch in sorted({1, max_batch}):
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        size = next(s for s in graphs.buckets if s >= batch)
        try:
            graphs.replay([1] * batch, [context] * batch, tables)
            profile = kernel_profile(graphs.graphs[size][0].replay)
            if "error" in profile:  # no kernel events seen inside graphs: the same step eagerly
                profile = {**kernel_profile(torch.inference_mode()(partial(graphs._step, size))), "eager": True,
                           "graph_error": profile["error"]}
        except Exception as exc:  # the profiler must not cost the figures
            profile = {"error": repr(exc)}
        result["decode"][batch]["profile"] = profile
        print_kernel_profile(f"{preset} {weight_format or 'bf16'}, batch {batch}, "
                             f"{'eager' if profile.get('eager') else 'graph replay'}", profile)
    del runner, graphs, loaded
    torch.cuda.empty_cache()
    return result


def launch_variants(runner, per_seq: int, context: int) -> dict[str, float | str]:
    """The batch-1 decode graph's replay (ms, median of 200) captured anew under each launch
    variant: the norms folded into the GEMVs or launched (``forward.FOLD_NORMS``), rotary + K/V
    write folded into the decode attention or launched (``forward.FOLD_ROPE``), programmatic
    dependent launch off or on (``kernels.set_pdl``); a variant that fails gives its error."""
    from vivace.gpu import forward as gpu_forward
    from vivace.gpu import kernels
    from vivace.gpu.runner import DecodeGraphs

    saved = gpu_forward.FOLD_NORMS, gpu_forward.FOLD_ROPE, kernels.set_pdl(False)
    variants = [(True, True, False, False), (True, True, True, False), (False, False, False, False),
                (False, False, True, False), (True, False, False, False), (False, True, False, False),
                (True, True, False, True), (True, True, True, True)]
    times: dict[str, float | str] = {}
    try:
        for norms, rope, pdl_on, triton_everywhere in variants:
            gpu_forward.FOLD_NORMS, gpu_forward.FOLD_ROPE = norms, rope
            kernels.set_pdl(pdl_on)
            name = (f"norms {'folded' if norms else 'launched'}, rotary {'folded' if rope else 'launched'}, "
                    f"PDL {'on' if pdl_on else 'off'}" + (", Triton GEMV for every float projection"
                                                          if triton_everywhere else ""))
            restore = triton_gemv_everywhere(runner.model) if triton_everywhere else None
            if triton_everywhere and not restore:
                continue  # cuBLAS kept nowhere (or no float projection): the same graph as above
            try:
                graphs = DecodeGraphs(runner, 1)
                graphs.replay([1], [context], [list(range(per_seq))])
                times[name] = timed(graphs.graphs[1][0].replay, 200) * 1e3
                del graphs
            except Exception as exc:  # PDL where the driver or capture refuses it
                times[name] = repr(exc)
            finally:
                for module, attribute, value in restore or ():
                    setattr(module, attribute, value)
    finally:
        gpu_forward.FOLD_NORMS, gpu_forward.FOLD_ROPE, pdl = saved
        kernels.set_pdl(pdl)
    torch.cuda.synchronize()
    return times


def triton_gemv_everywhere(model) -> list[tuple[object, str, int]]:
    """Sets the Triton GEMV (4 rows a program; K in 2 from 8,192 columns) on every float projection
    for which ``choose_gemv`` kept cuBLAS; returns what to set back. cuBLAS's kernels take no part
    in programmatic dependent launch and fold no norm: timed alone they won by 1-5% on the 8B's
    matrices, but in the chain of a step under PDL the Triton GEMV's loads may start earlier."""
    import torch.nn as nn

    restore = []
    for layer in model.layers:
        for module, prefix in ((layer.self_attn.qkv_proj, "gemv"), (layer.self_attn.o_proj, "gemv"),
                               (layer.mlp.gate_up_proj, "gemv"), (layer.mlp.down_proj, "gated_gemv")):
            if type(module) is nn.Linear and not getattr(module, f"{prefix}_block", 0):
                for attribute, value in ((f"{prefix}_block", 4), (f"{prefix}_splits", 2 if module.in_features >= 8192 else 1)):
                    restore.append((module, attribute, getattr(module, attribute, 0 if attribute.endswith("block") else 1)))
                    setattr(module, attribute, value)
    return restore


def engine_itl(preset: str, context: int, tokenizer: str | None, new_tokens: int = 128, reps: int = 3) -> dict:
    """Batch-1 inter-token time through ``LLMEngine.step`` (scheduling, the decode graph, the
    device sampler, detokenization and stop checks: the serving loop less HTTP), median over
    ``reps`` requests of a ``context``-token prompt, with the overlap scheduler on and off."""
    from vivace.config import EngineConfig
    from vivace.engine.llm_engine import LLMEngine
    from vivace.engine.sampling_params import SamplingParams
    from vivace.models import load_model

    max_len = context + new_tokens + 16
    loaded = load_model(preset, DTYPE, load_format="dummy", device="cuda", tokenizer=tokenizer)
    result = {}
    for overlap in (True, False):
        config = EngineConfig(model=preset, dtype="bfloat16", load_format="dummy", tokenizer=tokenizer,
                              device="cuda", max_model_len=max_len, num_kv_blocks=2 * -(-max_len // 16),
                              max_num_seqs=4, cuda_graph_max_batch=4, overlap_schedule=overlap)
        engine = LLMEngine(config, loaded)
        gaps: list[float] = []
        for rep in range(reps):
            engine.add_request(f"r{rep}", [1] * context, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                                        ignore_eos=True))
            stamps = []
            while engine.has_unfinished():
                stamps += [time.perf_counter()] * len(engine.step())
            gaps += [b - a for a, b in zip(stamps[1:], stamps[2:])]  # after the first token
        result["overlap" if overlap else "serial"] = statistics.median(gaps) * 1e3
        del engine
        torch.cuda.empty_cache()
    return result


def batched_bench(preset: str, streams: list[int], prompt: int = 512, new_tokens: int = 128,
                  tokenizer: str | None = None, device: str = "cuda") -> list[dict]:
    """llama-batched-bench's figures through ``LLMEngine.step`` (what its S_TG counts: issue 17's
    llama.cpp figures, 937 / 3,165 / 4,823 tokens/s at 8 / 32 / 64 streams on the 8B shape): per
    stream count B, B requests of ``prompt`` tokens sent at once, ``new_tokens`` each. T_PP: until
    every request has its first token; T_TG: from then to the end, all B decoding. S_PP = B x
    prompt / T_PP, S_TG = the tokens emitted during T_TG / T_TG, S = every prompt and output token /
    the whole time. The engine schedules as it serves (prompt chunks beside decodes), so streams
    that got their first token early decode during T_PP: those tokens count in S, not in S_TG."""
    from vivace.config import EngineConfig
    from vivace.engine.llm_engine import LLMEngine
    from vivace.engine.sampling_params import SamplingParams
    from vivace.models import load_model

    max_len = prompt + new_tokens + 16
    dtype = DTYPE if device == "cuda" else torch.float32
    loaded = load_model(preset, dtype, load_format="dummy", device=device, tokenizer=tokenizer)
    most = max(streams)
    config = EngineConfig(model=preset, dtype="bfloat16" if device == "cuda" else "float32",
                          load_format="dummy", tokenizer=tokenizer, device=device, max_model_len=max_len,
                          num_kv_blocks=most * -(-max_len // 16) + 16, max_num_seqs=most,
                          cuda_graph_max_batch=most if device == "cuda" else 0,
                          enable_prefix_caching=False)  # every prompt computed, as llama-batched-bench's
    engine = LLMEngine(config, loaded)  # one engine (its graphs captured once) for every stream count
    for warm in range(2):  # the warm-up compiles and teaches the pacer
        engine.add_request(f"w{warm}", [1] * prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    rows = []
    for batch in streams:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", [1 + (batch * 131 + i * 7919 + j) % 30000 for j in range(prompt)],
                               params)
        first: dict[str, float] = {}
        stamps: list[float] = []
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                first.setdefault(output.request_id, now)
                stamps.append(now)
        end, all_first = time.perf_counter(), max(first.values())
        t_pp, t_tg = all_first - start, end - all_first
        decoded = sum(1 for t in stamps if t > all_first)
        rows.append({"streams": batch, "prompt": prompt, "new_tokens": new_tokens, "t_pp_s": t_pp, "t_tg_s": t_tg,
                     "s_pp": batch * prompt / t_pp, "s_tg": decoded / t_tg if t_tg > 0 else float("nan"),
                     "s": (batch * prompt + len(stamps)) / (end - start), "tokens": len(stamps)})
    del engine, loaded
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_batched_bench(preset: str, rows: list[dict]) -> None:
    first = rows[0] if rows else {"prompt": "?", "new_tokens": "?"}
    print(f"\n{preset}, as llama-batched-bench (PP {first['prompt']}, TG {first['new_tokens']}; llama.cpp's 8B "
          "figures are S_TG)\n")
    print("| B | T_PP | S_PP | T_TG | S_TG | S |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['t_pp_s']:.3f} s | {r['s_pp']:,.0f} t/s | {r['t_tg_s']:.3f} s | "
              f"{r['s_tg']:,.0f} t/s | {r['s']:,.0f} t/s |")
    sys.stdout.flush()


def hf_itl(preset: str, context: int) -> float | None:
    """Hugging Face transformers' ITL (seconds) at batch 1: static cache + torch.compile (what
    ``cache_implementation="static"`` compiles), random weights at the preset's shape."""
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in PRESETS[preset].items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPE).eval()
    ids = torch.randint(0, config.vocab_size, (1, context), device="cuda")

    def run(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(96)  # compiles
    short, long = statistics.median(run(32) for _ in range(3)), statistics.median(run(96) for _ in range(3))
    del model
    torch.cuda.empty_cache()
    return (long - short) / 64


GEMV_SHAPES = {"gate+up 28672x4096": (28672, 4096), "down 4096x14336": (4096, 14336),
               "qkv 6144x4096": (6144, 4096), "LM head 128256x4096": (128256, 4096)}


def gemv_rows() -> dict:
    """TB/s of cuBLAS ``torch.mv`` and vivace's Triton GEMV at the 8B shape's matrices, bf16,
    weights rotated through copies larger than L2 so that each call reads HBM, replayed from a CUDA
    graph as in the decode step (no launch cost)."""
    from vivace.gpu import kernels
    from vivace.gpu.forward import _time_us

    rows = {}
    for name, (n, k) in GEMV_SHAPES.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") for _ in range(copies)]
        x = torch.randn(k, dtype=DTYPE, device="cuda")
        ours = _time_us(lambda: [kernels.gemv(w, x) for w in weights], 20) / 1e6 / copies
        theirs = _time_us(lambda: [torch.mv(w, x) for w in weights], 20) / 1e6 / copies
        rows[name] = {"cublas_tb_s": n * k * 2 / theirs / 1e12, "triton_tb_s": n * k * 2 / ours / 1e12}
        del weights
    torch.cuda.empty_cache()
    return rows


def random_format_module(weight_format: str, n: int, k: int, seed: int) -> torch.nn.Module:
    """A random ``n x k`` projection on the GPU in ``weight_format``: a GGUF type (random blocks,
    laid out as the loader lays them, ``GgufLinear``) or "fp8" (random bf16 quantized, ``Fp8Linear``)."""
    from vivace.gpu.fp8_linear import Fp8Linear
    from vivace.gpu.gguf_linear import GgufLinear
    from vivace.models.dummy import random_gguf_blocks

    if weight_format == "fp8":
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return Fp8Linear.from_float(torch.randn(n, k, dtype=DTYPE, device="cuda", generator=generator))
    ggml_type = gguf.GGMLQuantizationType[weight_format]
    return GgufLinear(random_gguf_blocks(ggml_type, n, k, "cuda", seed), ggml_type, k)


def format_matrix_rows(formats: list[str], prefill_rows: int = 512) -> dict:
    """Per 8B matrix: cuBLAS's ``prefill_rows``-row GEMM on bf16 (TFLOP/s) and, per format (GGUF
    types, "fp8"), vivace's batch-1 GEMV (TB/s of the format's bytes, weights rotated through
    copies larger than L2, replayed from a CUDA graph) at the launcher's default tiling and at the
    best of the module's ``gemv_candidates()`` (what ``forward.choose_gemv`` would keep), and the
    ``prefill_rows``-row GEMM (TFLOP/s, launch costs included)."""
    import torch.nn.functional as F

    from vivace.gpu.forward import _time_us

    rows = {}
    for name, (n, k) in GEMV_SHAPES.items():
        flops = 2 * prefill_rows * n * k
        x1 = torch.randn(1, k, dtype=DTYPE, device="cuda")
        xm = torch.randn(prefill_rows, k, dtype=DTYPE, device="cuda")
        dense = torch.randn(n, k, dtype=DTYPE, device="cuda")
        row: dict = {"cublas_gemm_tflop_s": flops / timed(lambda: F.linear(xm, dense), 10) / 1e12}
        del dense
        for weight_format in formats:
            first = random_format_module(weight_format, n, k, 0)
            nbytes = first.weight_bytes()
            copies = max(2, -(-(256 << 20) // nbytes))
            modules = [first] + [random_format_module(weight_format, n, k, seed) for seed in range(1, copies)]

            def gemv_us(config) -> float:
                for module in modules:
                    module.gemv_config = config
                return _time_us(lambda: [module(x1) for module in modules], 20) / copies

            default = gemv_us(None)
            best, best_config = min(((gemv_us(c), str(c).removeprefix("GemvConfig")) for c in first.gemv_candidates()),
                                    default=(default, "defaults"))
            gemm = timed(lambda: first(xm), 10)
            row[weight_format] = {"gemv_us": default, "gemv_tb_s": nbytes / default / 1e6,
                                  "best_gemv_us": best, "best_gemv_tb_s": nbytes / best / 1e6,
                                  "best_config": best_config, "gemm_ms": gemm * 1e3,
                                  "gemm_tflop_s": flops / gemm / 1e12}
            del modules, first
        rows[name] = row
    torch.cuda.empty_cache()
    return rows


def prefill_cell(row: dict, length: int) -> str:
    """A prefill time: eager, and the graph replay's in parentheses where one ran."""
    graph = row["prefill_graph_ms"].get(length)
    return f"{row['prefill_ms'][length]:.2f} ms" + ("" if graph is None else f" ({graph:.2f} ms graph)")


def print_format_rows(preset: str, context: int, rows: list[dict], bandwidth: float) -> None:
    """One table per preset: each weight format's decode steps against its floor, and its prefill."""
    prompts = sorted({length for row in rows for length in row["prefill_ms"]})
    print(f"\n## {preset}, projections in GGUF formats or FP8 (embedding, norms, KV bf16; FP8 keeps the LM head "
          f"bf16), context {context}\n")
    print("| format | batch | weight bytes | floor (weights + KV) | graph replay | engine step | replay / floor | "
          + " | ".join(f"prefill {p}" for p in prompts) + " |")
    print("|---" * (7 + len(prompts)) + "|")
    for row in rows:
        for batch, d in row["decode"].items():
            floor = (d["weight_bytes"] + d["kv_bytes"]) / bandwidth * 1e3
            d["floor_ms"] = floor
            prefill = " | ".join(prefill_cell(row, p) if batch == 1 else "" for p in prompts)
            print(f"| {row['format']} | {batch} | {d['weight_bytes'] / 1e9:.2f} GB | {floor:.3f} ms | "
                  f"{d['replay_ms']:.3f} ms | {d['step_ms']:.3f} ms | {d['replay_ms'] / floor:.2f}x | {prefill} |")
    sys.stdout.flush()


def kv_comparison(preset: str, kv_dtypes: list[str], args: argparse.Namespace, bandwidth: float) -> dict:
    """``kv_dtype_rows`` of each of ``kv_dtypes``, printed; a dtype that fails is reported and skipped."""
    contexts = [int(c) for c in args.kv_contexts.split(",") if c]
    batches = [int(b) for b in args.kv_batches.split(",") if b]
    rows = []
    for kv_dtype in kv_dtypes:
        try:
            rows.append(kv_dtype_rows(preset, kv_dtype, contexts, batches, args.tokenizer))
        except Exception as exc:
            print(f"\n{preset} with a {kv_dtype} KV cache: vivace failed: {exc!r}", flush=True)
            rows.append({"preset": preset, "kv_dtype": kv_dtype, "error": repr(exc)})
            torch.cuda.empty_cache()
    print_kv_dtype_rows(preset, [r for r in rows if "error" not in r], bandwidth)
    return {"preset": preset, "kv_dtypes": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--prompts", default="128,512,2048")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' compiled decode")
    parser.add_argument("--hf-presets", default="", help="transformers' compiled decode for these presets only "
                        "(comma-separated; default: every preset unless --no-hf; each compiles for a minute or more)")
    parser.add_argument("--gguf-types", default="Q8_0,Q4_0,Q4_K",
                        help="GGUF formats to run the presets in too (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
                        "Q6_K, or Q4_K_M: llama-quantize's mix of Q4_K and Q6_K; '' none)")
    parser.add_argument("--gguf-batches", default="", help="decode batches of the GGUF runs besides 1")
    parser.add_argument("--tokenizer", default=os.environ.get("VIVACE_TEST_TOKENIZER"),
                        help="tokenizer of the engine-loop rows (default: $VIVACE_TEST_TOKENIZER, else the "
                             "default model's)")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-loop ITL rows")
    parser.add_argument("--batched-streams", default="8,32,64",
                        help="llama-batched-bench's rows through the engine for these stream counts ('' none)")
    parser.add_argument("--fp8", action="store_true", help="run the presets with FP8 projections too")
    parser.add_argument("--fp8-batches", default="64", help="decode batches of the FP8 runs besides 1")
    parser.add_argument("--kv-dtypes", default="", help="KV cache dtypes to compare many streams in "
                        "(e.g. bfloat16,fp8; '' none)")
    parser.add_argument("--kv-contexts", default="512,4096", help="tokens per stream of the --kv-dtypes rows")
    parser.add_argument("--kv-batches", default="64", help="streams of the --kv-dtypes rows")
    parser.add_argument("--kv-only", action="store_true", help="run only the --kv-dtypes rows")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bandwidth_tb_s": bandwidth / 1e12, "presets": []}
    print(f"{report['device']}, torch {torch.__version__}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    batches = [int(b) for b in args.batches.split(",") if b]
    prompts = [int(p) for p in args.prompts.split(",") if p]
    kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    if args.kv_only:
        for preset in args.presets.split(","):
            report["presets"].append(kv_comparison(preset, kv_dtypes, args, bandwidth))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
        return 0
    try:
        report["gemv"] = gemv_rows()
    except Exception as exc:
        report["gemv"] = {}
        print(f"GEMV comparison failed: {exc!r}", flush=True)
    print("\n| matrix (bf16) | cuBLAS torch.mv (graph replay) | Triton GEMV (graph replay) |\n|---|---|---|")
    for name, g in report["gemv"].items():
        print(f"| {name} | {g['cublas_tb_s']:.2f} TB/s | {g['triton_tb_s']:.2f} TB/s |")
    # Weight format -> its decode batches besides 1.
    formats = {t: [int(b) for b in args.gguf_batches.split(",") if b] for t in args.gguf_types.split(",") if t}
    if args.fp8:
        formats["fp8"] = [int(b) for b in args.fp8_batches.split(",") if b]
    matrix_formats = [t for t in formats if t != "Q4_K_M"]  # a mix has no one matrix of its own
    if matrix_formats:
        try:
            report["format_matrices"] = format_matrix_rows(matrix_formats)
        except Exception as exc:
            report["format_matrices"] = {}
            print(f"Weight format matrix comparison failed: {exc!r}", flush=True)
        print("\n| matrix | cuBLAS bf16 GEMM, 512 rows | "
              + " | ".join(f"{t} GEMV (batch 1) | {t} GEMM (512 rows)" for t in matrix_formats) + " |")
        print("|---" * (2 + 2 * len(matrix_formats)) + "|")
        for name, g in report["format_matrices"].items():
            cells = " | ".join(f"{g[t]['gemv_us']:.1f} us, {g[t]['gemv_tb_s']:.2f} TB/s (best "
                               f"{g[t]['best_gemv_us']:.1f} us, {g[t]['best_gemv_tb_s']:.2f} TB/s: {g[t]['best_config']}) | "
                               f"{g[t]['gemm_ms']:.3f} ms, {g[t]['gemm_tflop_s']:.0f} TFLOP/s" for t in matrix_formats)
            print(f"| {name} | {g['cublas_gemm_tflop_s']:.0f} TFLOP/s | {cells} |")
    for preset in args.presets.split(","):
        try:
            row = vivace_rows(preset, args.context, batches, prompts, tokenizer=args.tokenizer)
        except Exception as exc:  # one preset's failure must not lose the others' figures
            print(f"\n## {preset}: vivace failed: {exc!r}", flush=True)
            report["presets"].append({"preset": preset, "error": repr(exc)})
            torch.cuda.empty_cache()
            continue
        try:
            hf = not args.no_hf and (not args.hf_presets or preset in args.hf_presets.split(","))
            row["hf_static_compile_itl_ms"] = hf_itl(preset, args.context) * 1e3 if hf else None
        except Exception as exc:
            row["hf_static_compile_itl_ms"], row["hf_error"] = None, repr(exc)
            print(f"transformers failed on {preset}: {exc!r}", flush=True)
            torch.cuda.empty_cache()
        report["presets"].append(row)
        print(f"\n## {preset}, bf16, context {args.context}\n")
        print("| batch | floor (weights + KV) | graph replay | step, logits to host | step, device greedy "
              "| step, device top-p | replay / floor |")
        print("|---|---|---|---|---|---|---|")
        for batch, d in row["decode"].items():
            floor = (d["weight_bytes"] + d["kv_bytes"]) / bandwidth * 1e3
            d["floor_ms"] = floor
            print(f"| {batch} | {floor:.3f} ms | {d['replay_ms']:.3f} ms | {d['step_ms']:.3f} ms | "
                  f"{d['sampled_greedy_ms']:.3f} ms | {d['sampled_top_p_ms']:.3f} ms | {d['replay_ms'] / floor:.2f}x |")
        hf = row["hf_static_compile_itl_ms"]
        if hf is not None:
            one = row["decode"][1]["replay_ms"]
            print(f"\nHF static cache + torch.compile ITL {hf:.3f} ms; vivace graph replay {one:.3f} ms "
                  f"({one / hf:.2f}x)")
        if not args.no_engine:
            try:
                row["engine_itl_ms"] = engine_itl(preset, args.context, args.tokenizer)
                e = row["engine_itl_ms"]
                print(f"\nengine loop, batch 1 (LLMEngine.step, device greedy): ITL p50 {e['overlap']:.3f} ms with "
                      f"the overlap scheduler, {e['serial']:.3f} ms without; graph replay "
                      f"{row['decode'][1]['replay_ms']:.3f} ms")
            except Exception as exc:
                row["engine_error"] = repr(exc)
                print(f"engine loop failed on {preset}: {exc!r}", flush=True)
                torch.cuda.empty_cache()
        streams = [int(b) for b in args.batched_streams.split(",") if b]
        if streams and not args.no_engine:
            try:
                row["batched_bench"] = batched_bench(preset, streams, tokenizer=args.tokenizer)
                print_batched_bench(preset, row["batched_bench"])
            except Exception as exc:
                row["batched_bench_error"] = repr(exc)
                print(f"batched bench failed on {preset}: {exc!r}", flush=True)
                torch.cuda.empty_cache()
        print("\n| prompt tokens | prefill, eager (forward + LM head of the last token) | prefill, graph replay "
              "(inputs staged) |\n|---|---|---|")
        for length, ms in row["prefill_ms"].items():
            graph = row["prefill_graph_ms"].get(length)
            print(f"| {length} | {ms:.2f} ms | {'' if graph is None else f'{graph:.2f} ms'} |")
        sys.stdout.flush()
        format_rows = []
        for weight_format, format_batches in formats.items():
            try:
                format_rows.append(vivace_rows(preset, args.context, format_batches, prompts, weight_format,
                                                 args.tokenizer))
            except Exception as exc:
                print(f"\n{preset} in {weight_format}: vivace failed: {exc!r}", flush=True)
                format_rows.append({"preset": preset, "format": weight_format, "error": repr(exc)})
                torch.cuda.empty_cache()
        row["formats"] = format_rows
        print_format_rows(preset, args.context, [r for r in format_rows if "error" not in r], bandwidth)
        if kv_dtypes:
            row["kv_dtypes"] = kv_comparison(preset, kv_dtypes, args, bandwidth)["kv_dtypes"]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
