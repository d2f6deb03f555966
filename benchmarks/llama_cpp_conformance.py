"""vivace against llama.cpp's own toolchain and runtime on the same GGUF files: tiny random Hugging
Face models of each supported family (SmolLM2's real tokenizer and chat template, hidden size 256
so that every K-quant applies), converted by llama.cpp's ``convert_hf_to_gguf.py`` to F16 and BF16,
quantized by ``llama-quantize``, then served by vivace and by ``llama-server`` side by side.

For each file and prompt llama-server's greedy continuation (with its ``n_probs`` top logprobs) is
scored by vivace (``prompt_logprobs`` over prompt + continuation, teacher-forced) and by transformers
in float32: on the Hugging Face model for F16/BF16, on the file's weights dequantized by gguf-py (as
llama.cpp dequantizes them) for the quantized types, the reference for both servers. The table gives
top-1 agreement per position and the largest |logprob| difference over the tokens both top-k lists
hold, plus whether vivace's own greedy continuation is llama-server's, its tokenization and chat
rendering are llama-server's, and both stop at the same end-of-generation tokens.

    python benchmarks/llama_cpp_conformance.py [--families llama,qwen3] [--types F16,Q4_K_M]
        [--llama-cpp DIR] [--convert-python PYTHON] [--work DIR] [--vivace-args '--eager'] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import transformers

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this vivace
from conformance_models import FAMILIES, build_model, dequantized_model, hf_logprobs  # noqa: E402
from peers import PeerUnavailable, Running, Server, free_port  # noqa: E402

LLAMA_CPP = Path.home() / ".cache/vivace-peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
FLOAT_TYPES = ("F16", "BF16")
FUSED_QKV = "+fuse-qkv"  # a float type converted with --fuse-qkv (q, k, v stored as one attn_qkv)
QUANT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q4_0", "Q5_0", "Q4_1",
               "Q1_0")
PROMPTS = ["The quick brown fox jumps over the lazy dog. Then",
           "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Numbers: 3.14159, 2,718 and 1e-9; émigré naïve 東京 🦊!",
           "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to three."}]]
TOP_K = 8


@dataclass
class Row:
    family: str
    ggml_type: str
    top1_llama: str = "-"
    lp_llama: str = "-"
    top1_hf: str = "-"
    lp_hf: str = "-"
    llama_hf: str = "-"
    greedy: str = "-"
    tokens: str = "-"
    chat: str = "-"
    stops: str = "-"
    note: str = ""

    def cells(self) -> list[str]:
        return [self.family, self.ggml_type, self.top1_llama, self.lp_llama, self.top1_hf, self.lp_hf,
                self.llama_hf, self.greedy, self.tokens, self.chat, self.stops, self.note]


HEADER = ["family", "type", "top-1 = llama.cpp", "max |Δlogprob| llama.cpp", "top-1 = HF ref",
          "max |Δlogprob| HF ref",
          "llama.cpp vs HF ref", "greedy = llama.cpp", "tokenize", "chat prompt", "EOG stops", "note"]


def convert(args: argparse.Namespace, hf_dir: Path, out: Path, outtype: str, add_bos: bool, *options: str) -> Path:
    """The converter's file; with ``add_bos`` its tokenizer.ggml.add_bos_token set by gguf-py's own script
    (the converter takes the flag from tokenizer.json's post-processor, and one that adds a BOS changes
    the tokenizer's hash, which the converter then does not know)."""
    if not out.exists():
        subprocess.run([str(args.convert_python), str(args.llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir),
                        "--outtype", outtype.lower(), "--outfile", str(out), *options], check=True, capture_output=True)
        if add_bos:
            script = args.llama_cpp / "gguf-py/gguf/scripts/gguf_set_metadata.py"
            subprocess.run([sys.executable, str(script), "--force", str(out), "tokenizer.ggml.add_bos_token", "1"],
                           check=True, capture_output=True)
    return out


def quantize(llama_cpp: Path, source: Path, out: Path, ggml_type: str) -> Path:
    if not out.exists():
        subprocess.run([str(llama_cpp / "build/bin/llama-quantize"), str(source), str(out), ggml_type, "1"],
                       check=True, capture_output=True)
    return out


def start(name: str, command: list[str], port: int, log: Path) -> tuple[Running, str]:
    running = Running(Server(name, command, name, start_timeout_s=300.0), log)
    url = f"http://127.0.0.1:{port}"
    try:
        running.wait_ready(url)
    except PeerUnavailable:
        running.stop()
        raise
    return running, url


def llama_greedy(url: str, prompt: list[int], n: int) -> tuple[str, list[int], list[dict[int, float] | None]]:
    """llama-server's greedy continuation: its text, its ids and its top-k logprobs at each position
    (None where llama-server gives none: a token that ends inside a UTF-8 character is reported
    merged with the next one, under the next one's id)."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": TOP_K, "cache_prompt": False,
            "return_tokens": True}
    reply = httpx.post(url + "/completion", json=body, timeout=120).json()
    tokens, probs = reply["tokens"], iter(reply["completion_probabilities"])
    scores, pending = [], next(probs, None)
    for token in tokens:
        if pending is not None and pending["id"] == token:
            scores.append({t["id"]: t["logprob"] for t in pending["top_logprobs"]})
            pending = next(probs, None)
        else:
            scores.append(None)
    return reply["content"], tokens, scores


def vivace_scores(url: str, prompt: list[int], continuation: list[int]) -> list[dict[int, float]]:
    """vivace's top-k logprobs at each continuation position, the continuation teacher-forced."""
    body = {"prompt": prompt + continuation, "max_tokens": 1, "temperature": 0, "prompt_logprobs": TOP_K}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    entries = reply["choices"][0]["prompt_logprobs"][len(prompt):]
    return [{int(k): v["logprob"] for k, v in e.items() if v["rank"] <= TOP_K} for e in entries]


def vivace_greedy(url: str, prompt: list[int], n: int) -> str:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


def compare(ours: list[dict[int, float] | None],
            theirs: list[dict[int, float] | None]) -> tuple[int, int, float]:
    """(positions whose top-1 agree, positions both score, max |logprob difference| over tokens in both)."""
    agree, count, worst = 0, 0, 0.0
    for a, b in zip(ours, theirs):
        if a and b:
            count += 1
            agree += max(a, key=a.get) == max(b, key=b.get)
            worst = max([worst, *(abs(a[t] - b[t]) for t in a.keys() & b.keys())])
    return agree, count, worst


def tokenization(vivace: str, llama: str) -> tuple[list[list[int]], str]:
    """llama-server's ids of each prompt (as /completion would) and how many vivace tokenizes alike."""
    ids, same = [], 0
    for text in PROMPTS:
        theirs = httpx.post(llama + "/tokenize", json={"content": text, "add_special": True,
                                                       "parse_special": True}).json()["tokens"]
        ours = httpx.post(vivace + "/tokenize", json={"prompt": text, "add_special_tokens": True}).json()["tokens"]
        same += ours == theirs
        ids.append(theirs)
    return ids, f"{same}/{len(PROMPTS)}"


def chat_prompts(vivace: str, llama: str) -> str:
    same = 0
    for messages in CHATS:
        text = httpx.post(llama + "/apply-template", json={"messages": messages}).json()["prompt"]
        theirs = httpx.post(llama + "/tokenize", json={"content": text, "add_special": True,
                                                       "parse_special": True}).json()["tokens"]
        ours = httpx.post(vivace + "/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
        same += ours["tokens"] == theirs
    return f"{same}/{len(CHATS)}"


def eog_stops(vivace: str, llama: str, eog: list[int]) -> str:
    """Each end-of-generation token forced by logit bias: does each server stop on it at once?"""
    same = 0
    for token in eog:
        messages = CHATS[0]
        theirs = httpx.post(llama + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 4, "temperature": 0, "logit_bias": {str(token): 100}}).json()
        ours = httpx.post(vivace + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 4, "temperature": 0, "logit_bias": {str(token): 100}}).json()
        stopped = [r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] <= 1
                   for r in (theirs, ours)]
        same += stopped[0] == stopped[1]
    return f"{same}/{len(eog)}"


def probe_file(args: argparse.Namespace, path: Path, row: Row, hf_model: transformers.PreTrainedModel,
               eog: list[int], logs: Path) -> None:
    lport, vport = free_port(), free_port()
    llama_cmd = [str(args.llama_cpp / "build/bin/llama-server"), "-m", str(path), "--host", "127.0.0.1",
                 "--port", str(lport), "-t", "1", "-np", "1", "-c", str(args.context), "--jinja"]
    vivace_cmd = [sys.executable, "-m", "vivace.cli", "serve", str(path), "--host", "127.0.0.1", "--port",
                  str(vport), "--num-threads", "1", "--dtype", args.dtype, "--max-model-len", str(args.context),
                  "--no-ui",
                  *args.vivace_args.split()]
    llama, llama_url = start("llama.cpp", llama_cmd, lport, logs / f"{path.stem}.llama.log")
    try:
        try:
            vivace, vivace_url = start("vivace", vivace_cmd, vport, logs / f"{path.stem}.vivace.log")
        except PeerUnavailable as error:
            row.note = f"vivace failed: {error}"
            return
        try:
            prompts, row.tokens = tokenization(vivace_url, llama_url)
            row.chat = chat_prompts(vivace_url, llama_url)
            row.stops = eog_stops(vivace_url, llama_url, eog)
            totals = {"llama": [0, 0, 0.0], "hf": [0, 0, 0.0], "llama_hf": [0, 0, 0.0]}
            greedy_same = 0
            for prompt in prompts:
                text, continuation, theirs = llama_greedy(llama_url, prompt, args.tokens)
                ours = vivace_scores(vivace_url, prompt, continuation)
                greedy_same += vivace_greedy(vivace_url, prompt, args.tokens) == text
                reference = hf_logprobs(hf_model, prompt, continuation, 8 * TOP_K)
                results = {"llama": compare(ours, theirs), "hf": compare(ours, reference),
                           "llama_hf": compare(theirs, reference)}
                for key, (agree, count, worst) in results.items():
                    total = totals[key]
                    total[0], total[1], total[2] = total[0] + agree, total[1] + count, max(total[2], worst)
            row.greedy = f"{greedy_same}/{len(prompts)}"
            row.top1_llama, row.lp_llama = f"{totals['llama'][0]}/{totals['llama'][1]}", f"{totals['llama'][2]:.3f}"
            row.top1_hf, row.lp_hf = f"{totals['hf'][0]}/{totals['hf'][1]}", f"{totals['hf'][2]:.3f}"
            row.llama_hf = f"{totals['llama_hf'][0]}/{totals['llama_hf'][1]}, {totals['llama_hf'][2]:.3f}"
        finally:
            vivace.stop()
    finally:
        llama.stop()


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row.cells()) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated; known: " + ", ".join(FAMILIES))
    parser.add_argument("--types", default=",".join(FLOAT_TYPES + (FLOAT_TYPES[0] + FUSED_QKV,) + QUANT_TYPES),
                        help=f"GGUF types to make and compare (F16{FUSED_QKV}: converted with --fuse-qkv)")
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP,
                        help="llama.cpp checkout with convert_hf_to_gguf.py and build/bin/llama-{server,quantize}")
    parser.add_argument("--convert-python", type=Path, default=Path(sys.executable),
                        help="python for convert_hf_to_gguf.py (vivace's packages plus sentencepiece)")
    parser.add_argument("--work", type=Path, default=Path("bench-results/llama-cpp-conformance"),
                        help="models, GGUF files, server logs and results.json")
    parser.add_argument("--dtype", default="float32", help="vivace's --dtype (auto: bfloat16 for F16/BF16 files)")
    parser.add_argument("--vivace-args", default="--eager",
                        help="more vivace serve flags, e.g. '--eager --quantization none' "
                             "('' compiles the decode step)")
    parser.add_argument("--context", type=int, default=2048,
                        help="both servers' context (-c, --max-model-len); past 4096 Phi-3's LongRoPE takes its long "
                             "factors in llama.cpp and vivace, while transformers takes them by sequence length")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    args = parser.parse_args(argv)
    args.work = args.work.resolve()  # the servers run in the repository root
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in args.families.split(","):
        hf_dir, model, eog = build_model(family, args.work / family)
        add_bos = FAMILIES[family][2]
        f16 = None
        for ggml_type in args.types.split(","):
            row = Row(family, ggml_type)
            rows.append(row)
            try:
                out = args.work / family / f"{family}-{ggml_type}.gguf"
                if ggml_type in FLOAT_TYPES:
                    path = convert(args, hf_dir, out, ggml_type, add_bos)
                elif ggml_type.endswith(FUSED_QKV):
                    path = convert(args, hf_dir, out, ggml_type.removesuffix(FUSED_QKV), add_bos, "--fuse-qkv")
                else:
                    f16 = f16 or convert(args, hf_dir, args.work / family / f"{family}-F16.gguf", "F16",
                                        add_bos)
                    path = quantize(args.llama_cpp, f16, out, ggml_type)
                is_float = ggml_type.removesuffix(FUSED_QKV) in FLOAT_TYPES
                reference = model if is_float else dequantized_model(model, path)
                probe_file(args, path, row, reference, eog, args.work / family)
            except (subprocess.CalledProcessError, PeerUnavailable, httpx.HTTPError, KeyError, ValueError) as error:
                detail = getattr(error, "stderr", b"") or b""
                row.note = f"{type(error).__name__}: {str(error)[:120]} {detail[-200:].decode(errors='replace')}"
            print(" | ".join(row.cells()), flush=True)
            (args.work / "results.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
