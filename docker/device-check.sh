#!/usr/bin/env bash
# The GPU path in one short, prepared run: the main job's sweep on the Llama-3-8B-shaped model (seeded random
# bf16 weights made on the GPU, nothing downloaded) for the transformers engines, the suites' GPU-only
# assertions for them, GPU telemetry on, and the reports. Sized to finish within 8 minutes on one H200; every
# step has its own time limit, so a slow step ends with what it measured rather than eating the next one's time.
#
# Needs: torch and transformers (a CUDA build on the GPU host) and batchbench's own requirements; nvidia-ml-py for
# the telemetry (without it every run says "no NVML: ..."). Reaches no network (HF_HUB_OFFLINE): a requirement
# that is missing is installed only from a local folder of wheels, BATCHBENCH_WHEELS (docs/gpu.md says how to make
# one), and batchbench itself, where it is not installed, from this checkout (pip --no-index), else imported from
# it through a folder of links. Run from anywhere: it works from the repository root.
#
#   docker/device-check.sh [--engines hf-static,hf-continuous] [--model llama-3-8b-shaped] [--levels 1,4,16,64]
#                          [--repeats 2] [--suites "suites/test_....py ..."|none]
#                          [--gpu-hour-cost USD] [--out DIR] [--llamacpp-cuda ARCHS [--llamacpp-source TAR]]
#
# --llamacpp-cuda 90 (the GPU's compute capability, without the dot) first builds llama.cpp's server with CUDA for
# that architecture only and without its FlashAttention kernels (most of the compile), from the packed source the
# host cannot download (TAR, default build/llamacpp-src/llama.cpp-*-src.tar.gz, 8 MB: make it on a machine with
# an index with `python -m batchbench.adapters.launch.llamacpp_build pack build/llamacpp-src`); every engine then
# runs as a local process, llamacpp on that build with every layer on the GPU. Needs nvcc and cmake. Sized for a
# lent GPU's 15 minutes: `--engines llamacpp --llamacpp-cuda 90 --model tiny-llama --suites none` (a build of a
# few minutes on 16 cores, then the main job; an 8B-shaped GGUF of seeded weights is 16 GB to write and convert).
#
# An engine the registry does not have (yet) is skipped, and the log says so. Output: DIR (default $OUT/device-check
# when OUT is set, else results/device-check-<UTC time>): host.txt, nvidia-smi.txt, plan.json (the planner's
# prediction for the model on this GPU), run/ (the main job's folder: results and report/), suites/ (the suites'
# results, junit.xml and report/), one log per step and status.txt (each step's exit status).
# Exit status: 0 every step passed; otherwise the first failing step's.
#
# The reduced form CI runs on a CPU (tests/test_device_check.py):
#   docker/device-check.sh --engines hf-static --model tiny-llama --levels 1,2 --repeats 1 ...
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

ENGINES="hf-static,hf-continuous"
MODEL="llama-3-8b-shaped"
LEVELS="1,4,16,64"
REPEATS=2
SUITES="suites/test_static_vs_continuous.py suites/test_regimes.py"
GPU_HOUR_COST=""
PYTHON="${PYTHON:-python}"
stamp="$(date -u +%Y%m%d-%H%M%S)"
DIR=""
# Seconds each step may take: with the two model builds (about half a minute each on an H200) the sum stays under
# 8 minutes.
RUN_LIMIT="${BATCHBENCH_RUN_LIMIT:-240}"
SUITES_LIMIT="${BATCHBENCH_SUITES_LIMIT:-190}"
LLAMACPP_BUILD_LIMIT="${BATCHBENCH_LLAMACPP_BUILD_LIMIT:-480}"
LLAMACPP_CUDA=""
LLAMACPP_SOURCE=""

usage() { sed -n '13,15p' "$0" | sed 's/^# *//'; exit 2; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --engines) ENGINES="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --levels) LEVELS="$2"; shift 2 ;;
        --repeats) REPEATS="$2"; shift 2 ;;
        --suites) SUITES="$2"; shift 2 ;;
        --gpu-hour-cost) GPU_HOUR_COST="$2"; shift 2 ;;
        --out) DIR="$2"; shift 2 ;;
        --llamacpp-cuda) LLAMACPP_CUDA="$2"; shift 2 ;;
        --llamacpp-source) LLAMACPP_SOURCE="$2"; shift 2 ;;
        -h|--help) usage ;;
        *) echo "device-check: unknown option $1" >&2; usage ;;
    esac
done
if [[ -z "$DIR" ]]; then
    if [[ -n "${OUT:-}" ]]; then DIR="$OUT/device-check"; else DIR="results/device-check-$stamp"; fi
fi
mkdir -p "$DIR"
: >"$DIR/status.txt"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# Batchbench and its requirements, from this machine only (import name: package name).
plugin_args=()
missing="$("$PYTHON" -c '
import importlib.util
need = {"aiohttp": "aiohttp", "httptools": "httptools", "yarl": "yarl", "prometheus_client": "prometheus-client",
        "matplotlib": "matplotlib", "numpy": "numpy", "rich": "rich", "torch": "torch", "transformers": "transformers",
        "pytest": "pytest", "pytest_asyncio": "pytest-asyncio", "pytest_benchmark": "pytest-benchmark",
        "pytest_timeout": "pytest-timeout", "pynvml": "nvidia-ml-py"}
print(" ".join(pkg for module, pkg in need.items() if importlib.util.find_spec(module) is None))
')"
if [[ -n "$missing" && -n "${BATCHBENCH_WHEELS:-}" ]]; then
    echo "== installing $missing from $BATCHBENCH_WHEELS (no index)"
    # shellcheck disable=SC2086  # a list of package names
    "$PYTHON" -m pip install --no-index --find-links "$BATCHBENCH_WHEELS" $missing 2>&1 | tail -3 || true
elif [[ -n "$missing" ]]; then
    echo "device-check: not installed here: $missing (set BATCHBENCH_WHEELS to a folder of their wheels)" \
        | tee -a "$DIR/status.txt"
fi
if ! "$PYTHON" -c 'import batchbench.adapters.registry' 2>/dev/null; then
    if ! "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation -e . >"$DIR/install.log" 2>&1; then
        # No pip or setuptools to install with: the package's folders under their import names, as links.
        links="$(mktemp -d)"
        trap 'rm -rf "$links"' EXIT
        mkdir "$links/batchbench"
        for entry in batchbench/*; do ln -s "$PWD/$entry" "$links/batchbench/"; done
        for folder in adapters fixtures reports; do ln -s "$PWD/$folder" "$links/batchbench/$folder"; done
        export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}"
        plugin_args=(-p batchbench.pytest_plugin)  # no entry point without an install
        echo "device-check: batchbench imported from this checkout through links (not installed)" \
            | tee -a "$DIR/status.txt"
    fi
fi
status=0
step() {  # step NAME LIMIT_S COMMAND...: run it with its log and its limit, record its exit status
    local name="$1" limit="$2"; shift 2
    echo "== $name (at most ${limit}s)"
    local started=$SECONDS rc=0
    # SIGTERM first: batchbench stops its engines and folds what it measured; SIGKILL 20 s later.
    timeout --kill-after=20 "$limit" "$@" > >(tee "$DIR/$name.log") 2>&1 || rc=$?
    echo "$name: exit $rc after $((SECONDS - started))s" | tee -a "$DIR/status.txt"
    if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
}

# The engines asked for that the registry has; the others are skipped, said here and in status.txt.
known="$("$PYTHON" -c 'from batchbench.adapters.registry import engine_names; print(" ".join(engine_names()))')" || exit 3
engine_args=()
names=()
for name in ${ENGINES//,/ }; do
    if [[ " $known " == *" $name "* ]]; then
        engine_args+=(--engine "$name"); names+=("$name")
    else
        echo "device-check: skipping $name: no such engine in this batchbench (known: $known)" | tee -a "$DIR/status.txt"
    fi
done
if [[ ${#names[@]} -eq 0 ]]; then
    echo "device-check: none of $ENGINES can run" | tee -a "$DIR/status.txt"
    exit 3
fi
cost_args=()
if [[ -n "$GPU_HOUR_COST" ]]; then cost_args=(--gpu-hour-cost "$GPU_HOUR_COST"); fi
launch_args=()
if [[ -n "$LLAMACPP_CUDA" ]]; then
    if [[ -z "$LLAMACPP_SOURCE" ]]; then LLAMACPP_SOURCE="$(ls build/llamacpp-src/llama.cpp-*-src.tar.gz 2>/dev/null | head -1)"; fi
    if [[ -n "$LLAMACPP_SOURCE" ]]; then export BATCHBENCH_LLAMACPP_SOURCE="$PWD/${LLAMACPP_SOURCE#"$PWD"/}"; fi
    export BATCHBENCH_LLAMACPP_CUDA_ARCHS="$LLAMACPP_CUDA"
    launch_args=(--launch local)  # llamacpp on the CUDA build just made, not in a container
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "engines: ${names[*]}; model: $MODEL; levels: $LEVELS; repeats: $REPEATS; main job: at most ${RUN_LIMIT}s"
    if [[ -n "$LLAMACPP_CUDA" ]]; then
        echo "llama.cpp: CUDA build for architectures $LLAMACPP_CUDA from ${LLAMACPP_SOURCE:-the sdist (index needed)}"
        command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not on PATH"
    fi
    "$PYTHON" -c 'import platform, sys; print("python", sys.version.split()[0], platform.platform())'
    "$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-"); print("transformers", transformers.__version__)' \
        2>&1 || true
    "$PYTHON" -c 'import pynvml; print("nvidia-ml-py (pynvml)", getattr(pynvml, "__version__", "installed"))' 2>&1 || true
} | tee "$DIR/host.txt"
memory="139GiB"  # an H200's usable share, where no GPU says its own
if command -v nvidia-smi >/dev/null; then
    nvidia-smi >"$DIR/nvidia-smi.txt" 2>&1 || true
    mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 | tr -d ' ')"
    if [[ "$mib" =~ ^[0-9]+$ ]]; then memory="${mib}MiB"; fi
fi
# The planner's prediction for the model on this GPU, for 512+256-token requests (tests/test_planner.py states it
# for an H200); the run's report sets the engines' own KV figures beside the measured onset.
"$PYTHON" -m batchbench plan --model "$MODEL" --memory "$memory" --prompt-len 512 --output-len 256 --json \
    >"$DIR/plan.json" 2>"$DIR/plan.log" || echo "plan: exit $?" | tee -a "$DIR/status.txt"

if [[ -n "$LLAMACPP_CUDA" ]]; then
    step llamacpp-build "$LLAMACPP_BUILD_LIMIT" "$PYTHON" -m batchbench.adapters.launch.llamacpp_build build \
        --cuda-archs "$LLAMACPP_CUDA"
fi
step run "$RUN_LIMIT" "$PYTHON" -m batchbench run "${engine_args[@]}" --model "$MODEL" --levels "$LEVELS" \
    --repeats "$REPEATS" --max-repeats "$REPEATS" --time-limit "$((RUN_LIMIT - 20))" --results-dir "$DIR/run" \
    "${cost_args[@]}" "${launch_args[@]}"
for folder in "$DIR"/run/run-*; do  # cut short at its limit, the job wrote no report: what it measured still gets one
    if [[ -d "$folder" && ! -f "$folder/report/report.md" ]]; then
        step run-report 60 "$PYTHON" -m batchbench report "$folder" --out "$folder/report"
    fi
done

if [[ "$SUITES" != "none" ]]; then
    # One engine alive at a time: two 8B engines and their KV caches need not share the GPU.
    # shellcheck disable=SC2086  # SUITES is a list of test paths
    step suites "$SUITES_LIMIT" "$PYTHON" -m pytest $SUITES "${engine_args[@]}" --model "$MODEL" \
        --results-dir "$DIR/suites" --max-live-engines 1 --require-engines -p no:cacheprovider -q \
        --junitxml "$DIR/suites/junit.xml" "${cost_args[@]}" "${plugin_args[@]}" "${launch_args[@]}"
    step suites-report 60 "$PYTHON" -m batchbench report "$DIR/suites" --out "$DIR/suites/report"
fi
if command -v nvidia-smi >/dev/null; then nvidia-smi >"$DIR/nvidia-smi-after.txt" 2>&1 || true; fi
echo "device-check: exit $status; output in $DIR" | tee -a "$DIR/status.txt"
exit "$status"
