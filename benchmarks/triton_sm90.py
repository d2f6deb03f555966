"""Every Triton kernel launch of the CUDA backend at real model shapes, compiled for a GPU on a
machine without one: what Triton's interpreter accepts and compiled code rejects (block shapes,
dtypes, too much shared memory, spilled registers) shows here, before any GPU time is spent.

    python benchmarks/triton_sm90.py [--presets smollm2-135m,llama-3.2-1b,llama-3.1-8b] [--layers 1]
        [--formats bf16,fp8,Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K] [--models default,gemma-3-270m]
        [--kv-dtypes bfloat16,float8_e4m3fn] [--max-batch 64] [--arch 90] [--jobs 2] [--pdl]
        [--loops KERNEL,...] [--out FILE.json]

Two phases, each in its own process. Recording: the CUDA runner runs on CPU tensors under
Triton's interpreter with every launch recorded and not run, the interpreter's workarounds off
(float32 dots, whole-row sampling programs) so that each launch is the one a GPU gets: per
preset (random weights, ``--layers`` decoder layers, its widths real), weight format and KV
dtype, the decode graphs of every batch bucket up to ``--max-batch`` with their device-sampler
graphs and speculative verification graphs, the prompt-step graphs up to 512 tokens (their decode
rows through the decode kernel), the batch-1 GEMV candidates of ``choose_gemv``, and a 512-token
prefill; per ``--models`` entry (a preset-free model: the default GGUF, Gemma 3) the
same with its weights as stored. Compiling: each distinct launch (kernel, argument dtypes and
constexprs, num_warps/num_stages) through ``triton.compile`` for ``GPUTarget("cuda", arch, 32)``
with the installed Triton and its ptxas, then its registers, stack and spill bytes
(``cuobjdump -res-usage``) and its shared memory against the target's per-block limit.

Arguments are specialized as the JIT on a GPU specializes them: an integer equal to 1 becomes a
constant, one divisible by 16 and every pointer (torch's allocations are aligned) carry a
divisibility-by-16 hint, which lets loads vectorize (without the hints the decode attention
compiled to 255 registers and 4x the instructions, with them to 128). ``--loops KERNEL,...``
also prints, for each launch of those kernels, its longest loop's SASS (``cuobjdump -sass``):
instructions an iteration and the most frequent opcodes, a static measure of a kernel's main
loop to compare variants by without a GPU. Exit status 1 when a launch fails to compile or
exceeds shared memory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Per-block shared memory an SM can give one block (bytes), by compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
POINTER_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4nv",
                 "float8_e5m2": "fp8e5", "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32",
                 "int64": "i64", "bool": "i1"}
DEFAULT_FORMATS = "bf16,fp8,Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K"


# --- recording (under the interpreter) ----------------------------------------------------------


def describe(value: object) -> object:
    """A launch argument as JSON: a tensor by its dtype, a Triton dtype by name, scalars as they are."""
    import torch
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a launch argument of type {type(value).__name__} is not recorded")


def install_recorder(launches: dict[str, dict]) -> None:
    """Make every interpreted kernel launch add its description to ``launches`` instead of running;
    its integer tensors are zeroed, so that ids and indices it would have written (sampled tokens)
    are valid ones for the torch ops after it."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from vivace.gpu import fp8_kernels, fp8_linear, gguf_kernels, kernels, sampler

    # The launches a GPU gets: none of the interpreter's workarounds (float32 dots, whole-row samplers),
    # and an H100's SMs (132; a CPU device counts 1), so that the GEMVs' K splits are recorded too.
    kernels.INTERPRETED = sampler.INTERPRETED = False
    kernels.DOT_F32 = fp8_kernels.DOT_F32 = gguf_kernels.DOT_F32 = False
    for module in (fp8_kernels, fp8_linear, gguf_kernels):
        module.num_sms = lambda device: 132

    def record(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        launch = {"module": self.fn.__module__, "name": self.fn.__name__,
                  "args": {name: describe(value) for name, value in values.items()},
                  "options": {k: v for k, v in kwargs.items() if k not in names}}
        launches.setdefault(json.dumps(launch, sort_keys=True), launch)
        for value in values.values():
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                value.zero_()

    InterpretedFunction.run = record


def exercise(loaded, label: str, kv_dtype, launches: dict[str, dict], max_batch: int, prompt_len: int = 512) -> None:
    """Run ``loaded``'s CUDA runner on CPU as serving would launch its kernels (see the module doc)."""
    import torch

    from vivace.gpu import forward as gpu_forward
    from vivace.gpu.forward import prompt_batch
    from vivace.gpu.runner import CudaRunner

    before = len(launches)
    block_size, max_len = 16, 2048
    runner = CudaRunner(loaded, max_batch * (max_len // block_size), block_size, kv_dtype, max_len, device="cpu",
                        cuda_graph_max_batch=max_batch, verify_batch=min(8, max_batch), verify_tokens=4,
                        prefill_graph_tokens=prompt_len)
    timer = gpu_forward._time_us
    gpu_forward._time_us = lambda fn, repeats: (fn(), 1.0)[1]  # each candidate launched once, no timing
    try:
        gpu_forward.choose_gemv(loaded.model)
    finally:
        gpu_forward._time_us = timer
    batch = prompt_batch(torch.ones(prompt_len, dtype=torch.long), block_size)
    loaded.model.compute_logits(gpu_forward.forward(loaded.model, batch, runner.kv_caches, runner.kv_scales)[-1:])
    print(f"{label}, KV {str(kv_dtype).removeprefix('torch.')}: {len(launches) - before} new launch kinds",
          flush=True)


def record(args: argparse.Namespace) -> list[dict]:
    """The distinct launches of every preset x format and every model of ``args``."""
    import gguf
    import torch

    from vivace.gpu.gguf_linear import randomize_packed
    from vivace.models import load_model
    from vivace.models.dummy import PRESETS

    launches: dict[str, dict] = {}
    install_recorder(launches)
    kv_dtypes = [getattr(torch, name) for name in args.kv_dtypes.split(",") if name]
    with tempfile.TemporaryDirectory() as tmp:
        for preset in filter(None, args.presets.split(",")):
            config_dir = Path(tmp, preset)
            config_dir.mkdir()
            config = dict(PRESETS[preset], num_hidden_layers=args.layers)
            (config_dir / "config.json").write_text(json.dumps(config))
            for weight_format in filter(None, args.formats.split(",")):
                quantization = "fp8" if weight_format == "fp8" else "none"
                loaded = load_model(str(config_dir), torch.bfloat16, quantization, load_format="dummy", device="cpu",
                                    tokenizer=os.environ.get("VIVACE_TEST_TOKENIZER"))
                if weight_format not in ("bf16", "fp8"):
                    try:
                        randomize_packed(loaded.model, weight_format)
                    except ValueError as exc:  # K-quants need rows of multiples of 256
                        print(f"{preset} {weight_format}: skipped ({exc})", flush=True)
                        continue
                for kv_dtype in kv_dtypes:  # a runner per KV dtype over the same weights
                    exercise(loaded, f"{preset} ({args.layers} layers) {weight_format}", kv_dtype, launches,
                             args.max_batch)
        for model in filter(None, args.models.split(",")):
            loaded = load_model(model, torch.bfloat16, "auto", device="cpu", packed_gguf=True)  # as a GPU loads it
            for kv_dtype in kv_dtypes:
                exercise(loaded, model, kv_dtype, launches, args.max_batch)
    return list(launches.values())


# --- compiling (Triton's compiler, no interpreter) ----------------------------------------------


def decode(value: object) -> object:
    import triton.language as tl

    if isinstance(value, dict) and "tl_dtype" in value:
        return getattr(tl, value["tl_dtype"])
    return value


def argument_type(value: object) -> str:
    """The signature type of a non-constexpr argument."""
    if isinstance(value, dict) and "tensor" in value:
        return "*" + POINTER_TYPES[value["tensor"]]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {value!r}")


def compile_launch(launch: dict, arch: int, loops: tuple[str, ...] = ()) -> dict:
    """``launch`` compiled for ``arch``, its arguments specialized as the JIT would (module doc):
    its resources (and for a kernel named in ``loops``, its longest loop), or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        if param.name in launch["args"]:
            value = decode(launch["args"][param.name])
        else:
            value = param.default
        if param.is_constexpr or value is None or (type(value) is int and value == 1):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = argument_type(value)
            if signature[param.name].startswith("*") or (type(value) is int and value % 16 == 0):
                attrs[(index,)] = [["tt.divisibility", 16]]
    result = {"kernel": f"{launch['module'].rsplit('.', 1)[-1]}.{launch['name']}", "options": launch["options"],
              "constexprs": {k: str(v) for k, v in constexprs.items()}}
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                options=launch["options"])
    except Exception as exc:  # noqa: BLE001 - every compile error is a finding
        return result | {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["shared"] = kernel.metadata.shared
    result.update(resource_usage(kernel.asm["cubin"]))
    if launch["name"] in loops:
        result["loop"] = longest_loop(cuobjdump(kernel.asm["cubin"], "-sass"))
    return result


def longest_loop(sass: str) -> dict:
    """The longest loop of a kernel's SASS (the span of its longest backward branch): its
    instructions an iteration and their opcodes, most frequent first."""
    import re
    from collections import Counter

    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = [(int(target, 16), address) for address, text in code
             for target in re.findall(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text) if int(target, 16) < address]
    if not spans:
        return {"instructions": 0, "opcodes": {}}
    first, last = max(spans, key=lambda span: span[1] - span[0])
    opcodes = Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for address, text in code
                      if first <= address <= last)
    return {"instructions": sum(opcodes.values()), "opcodes": dict(opcodes.most_common())}


def cuobjdump(cubin: bytes, flag: str) -> str:
    """The output of the cuobjdump Triton ships, run with ``flag`` on ``cubin``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK and LOCAL of a cubin: a Triton kernel calls no functions, so a stack frame holds
    spilled registers (LOCAL stayed 0 beside a 488-byte frame whose loads were in the main loop)."""
    out = cuobjdump(cubin, "-res-usage")
    line = next((line for line in out.splitlines() if "REG:" in line), "")
    fields = dict(field.split(":", 1) for field in line.split() if ":" in field)
    return {key.lower(): int(fields[key]) for key in ("REG", "STACK", "LOCAL") if key in fields}


def compile_all(launches: list[dict], arch: int, jobs: int, loops: tuple[str, ...] = ()) -> list[dict]:
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(compile_launch, launches, [arch] * len(launches), [loops] * len(launches)))


def report(results: list[dict], arch: int) -> int:
    """Print a line per kernel (its launches summed up) and each failure; 1 if any failed."""
    limit = SHARED_LIMIT.get(arch)
    failed = [r for r in results if "error" in r or (limit and r["shared"] > limit)]
    by_kernel: dict[str, list[dict]] = {}
    for r in results:
        by_kernel.setdefault(r["kernel"], []).append(r)
    print(f"\n| kernel | launches compiled | max registers | max stack + local bytes (spills) | max shared (bytes) "
          f"| seconds |")
    print("|---|---|---|---|---|---|")
    for kernel, rows in sorted(by_kernel.items()):
        ok = [r for r in rows if "error" not in r]
        print(f"| {kernel} | {len(ok)} of {len(rows)} | {max((r.get('reg', 0) for r in ok), default='-')} | "
              f"{max((r.get('stack', 0) + r.get('local', 0) for r in ok), default='-')} | "
              f"{max((r['shared'] for r in ok), default='-')} | "
              f"{sum(r['seconds'] for r in ok):.0f} |")
    looped = [r for r in results if "loop" in r]
    if looped:
        print("\n| kernel | its constexprs that differ | registers | loop instructions an iteration | opcodes |"
              "\n|---|---|---|---|---|")
    for r in looped:
        same = {k for k in r["constexprs"] if len({o["constexprs"].get(k) for o in looped
                                                   if o["kernel"] == r["kernel"]}) == 1}
        differ = ", ".join(f"{k}={v}" for k, v in r["constexprs"].items() if k not in same)
        opcodes = ", ".join(f"{op} {n}" for op, n in list(r["loop"]["opcodes"].items())[:10])
        print(f"| {r['kernel']} | {differ} | {r.get('reg', '-')} | {r['loop']['instructions']} | {opcodes} |")
    for r in failed:
        what = r.get("error") or f"shared memory {r['shared']} > {limit}"
        print(f"\nFAILED {r['kernel']} {r['options']} {r['constexprs']}:\n  {what}")
    print(f"\n{len(results) - len(failed)} of {len(results)} launches compile for sm_{arch}"
          f"{f' within {limit} bytes of shared memory' if limit else ''}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of each preset (widths stay real)")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="bf16, fp8, GGUF types")
    parser.add_argument("--models", default="default,gemma-3-270m", help="models loaded as stored")
    parser.add_argument("--kv-dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--max-batch", type=int, default=64, help="the largest decode graph bucket")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--pdl", action="store_true",
                        help="compile the kernels that take part in programmatic dependent launch with it on")
    parser.add_argument("--loops", default="", help="kernels (names, comma-separated) whose longest loop's SASS "
                        "is counted, e.g. _decode_attention_kernel")
    parser.add_argument("--out", help="write every launch's result as JSON")
    parser.add_argument("--record-to", help=argparse.SUPPRESS)  # the recording process's output
    args = parser.parse_args()
    if args.record_to:
        Path(args.record_to).write_text(json.dumps(record(args)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        recorded = Path(tmp, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--record-to", str(recorded)], env=env, check=True)
        launches = json.loads(recorded.read_text())
    if args.pdl:  # recorded off (the interpreter never launches with it): as VIVACE_PDL=1 launches them
        for launch in launches:
            if "PDL" in launch["args"]:
                launch["args"]["PDL"] = True
                launch["options"]["launch_pdl"] = True
    print(f"{len(launches)} distinct launches recorded; compiling for sm_{args.arch} on {args.jobs} processes",
          flush=True)
    os.environ["TRITON_INTERPRET"] = "0"  # vivace.gpu leaves it as set
    results = compile_all(launches, args.arch, args.jobs, tuple(filter(None, args.loops.split(","))))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return report(results, args.arch)


if __name__ == "__main__":
    sys.exit(main())
