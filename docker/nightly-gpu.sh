#!/usr/bin/env bash
# The full batchbench profile on a GPU host: vLLM, TGI and TensorRT-LLM, each in
# its pinned container (adapters/images.toml), then the report; then the
# transformers engines (hf-static, hf-continuous) on the Llama-3-8B-shaped model
# they serve when no model is given (seeded random weights made on the GPU,
# nothing downloaded) through docker/device-check.sh. Every run records the GPU
# telemetry (power, energy, utilisation, memory, clocks; tokens per joule).
#
# Needs: an NVIDIA GPU with the NVIDIA Container Toolkit, a Docker Engine this
# user may use (DOCKER_HOST, or the local socket), a CUDA build of torch with
# transformers, and batchbench installed with its extras, editable:
# pip install -e '.[dev,docker,gpu]'. Run from the repository root.
#
# Environment:
#   BATCHBENCH_MODEL     Hugging Face model id (default below: small, ungated,
#                        a Llama that all three engines serve)
#   BATCHBENCH_RESULTS   results directory (default results/nightly-<UTC time>)
#   BATCHBENCH_RUN_ID    labels this run's containers (default nightly-<UTC time>)
#   BATCHBENCH_GPUS      "all" (default), "none" or device ids "0,1"
#   BATCHBENCH_GPU_HOUR_COST  USD per GPU-hour: each run's cost per million
#                        output tokens (unset: no cost figure)
#   BATCHBENCH_KEEP_OTHER_RUNS=1  do not remove other runs' leftover containers
#                        first (by default they are: on a dedicated GPU host a
#                        leftover holds GPU memory and skews every measurement)
#   HF_TOKEN             passed into the containers when set; never printed
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

stamp="$(date -u +%Y%m%d-%H%M%S)"
MODEL="${BATCHBENCH_MODEL:-TinyLlama/TinyLlama-1.1B-Chat-v1.0}"
RESULTS="${BATCHBENCH_RESULTS:-results/nightly-$stamp}"
export BATCHBENCH_RUN_ID="${BATCHBENCH_RUN_ID:-nightly-$stamp}"
PYTHON="${PYTHON:-python}"
export PYTHON
cost_args=()
if [[ -n "${BATCHBENCH_GPU_HOUR_COST:-}" ]]; then cost_args=(--gpu-hour-cost "$BATCHBENCH_GPU_HOUR_COST"); fi

mkdir -p "$RESULTS"

cleanup() {
    local status=$?
    echo "== removing this run's containers ($BATCHBENCH_RUN_ID)"
    "$PYTHON" -m batchbench.adapters.launch cleanup --run-id "$BATCHBENCH_RUN_ID" || true
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ "${BATCHBENCH_KEEP_OTHER_RUNS:-0}" != "1" ]]; then
    echo "== removing leftover batchbench containers of earlier runs"
    "$PYTHON" -m batchbench.adapters.launch cleanup
fi

echo "== host"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(hostname)"
    echo "run id: $BATCHBENCH_RUN_ID"
    echo "model: $MODEL"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
} | tee "$RESULTS/run.txt"
nvidia-smi | tee "$RESULTS/nvidia-smi.txt"
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,power.limit,clocks.max.sm \
    --format=csv >"$RESULTS/nvidia-smi.csv"
"$PYTHON" -m batchbench.adapters.launch images | tee "$RESULTS/images.txt"

# Pull before measuring, so no engine's start-up time includes a 10-60 GB download.
echo "== pulling the pinned images"
"$PYTHON" -m batchbench.adapters.launch pull vllm tgi trtllm | tee -a "$RESULTS/images.txt"

echo "== full profile"
status=0
"$PYTHON" -m pytest suites/ --engine vllm --engine tgi --engine trtllm --model "$MODEL" \
    --profile full --results-dir "$RESULTS/containers" --require-engines "${cost_args[@]}" || status=$?

# A report of a partial run is still worth having; the run's status is pytest's.
echo "== report"
"$PYTHON" -m batchbench report "$RESULTS/containers" --out "$RESULTS/report" || status=$((status ? status : 1))

# The transformers engines without --model: the 8B-shaped default on this GPU host.
echo "== transformers engines, Llama-3-8B-shaped"
bash docker/device-check.sh --out "$RESULTS/device-check" "${cost_args[@]}" || status=$((status ? status : $?))

nvidia-smi >"$RESULTS/nvidia-smi-after.txt" || true
exit "$status"
