#!/usr/bin/env bash
# Download a Hugging Face Llama checkpoint and convert it to the native format.
#
# Usage: scripts/prepare.sh REPO_ID [OUT_DIR]
#   REPO_ID  model repo on huggingface.co, e.g. meta-llama/Llama-2-7b-hf
#   OUT_DIR  where both copies go (default: checkpoints/REPO_ID)
#
# Layout:
#   OUT_DIR/hf/      the files as downloaded from huggingface.co (left untouched by conversion)
#   OUT_DIR/native/  model.safetensors + config.json + tokenizer.model, what generate.py loads
#
# Gated repos (Llama) need a token: export HF_TOKEN=... first. Extra arguments for the converter
# (e.g. --dtype bfloat16, --force) can be passed through CONVERT_ARGS.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 REPO_ID [OUT_DIR]" >&2
    exit 2
fi
repo_id=$1
out_dir=${2:-checkpoints/$repo_id}
scripts_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

python "$scripts_dir/download.py" --repo_id "$repo_id" --out_dir "$out_dir/hf"
# CONVERT_ARGS is split on spaces on purpose: it holds flags.
# shellcheck disable=SC2086
python "$scripts_dir/convert_hf_checkpoint.py" --checkpoint_dir "$out_dir/hf" --out_dir "$out_dir/native" ${CONVERT_ARGS:-}

echo "next: python generate.py --checkpoint_path $out_dir/native --prompt \"Hello, my name is\""
