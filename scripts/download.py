#!/usr/bin/env python3
"""Download the files a conversion needs from a Hugging Face model repo.

Fetches config.json, the tokenizer.model (top level or original/, where Llama-3 keeps it) and
the HF-format weights: model*.safetensors (+ index), or pytorch_model*.bin (+ index) only when
the repo has no safetensors. Other large files (Meta's original/consolidated.*.pth, Mistral's
consolidated.safetensors) are skipped.

Example:
  python scripts/download.py --repo_id meta-llama/Llama-2-7b-hf
  python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf \\
      --out_dir checkpoints/meta-llama/Llama-2-7b-hf-native
"""
import argparse
import os
import sys
from fnmatch import fnmatch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

COMMON = ["config.json", "tokenizer.model", "original/tokenizer.model"]
SAFETENSORS = ["model*.safetensors", "model.safetensors.index.json"]
BIN = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def choose_patterns(repo_files):
    """Safetensors when the repo has them (no unpickling, lazy loading); else the .bin files."""
    has_safetensors = any(fnmatch(f, SAFETENSORS[0]) for f in repo_files)
    return COMMON + (SAFETENSORS if has_safetensors else BIN)


def download(repo_id, out_dir, token):
    try:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        raise ValueError("huggingface_hub is not installed (pip install huggingface_hub)") from None
    try:
        patterns = choose_patterns(HfApi().list_repo_files(repo_id, token=token))
        snapshot_download(repo_id, local_dir=out_dir, allow_patterns=patterns, token=token)
    except GatedRepoError:
        raise ValueError(f"{repo_id} is gated: accept its license on huggingface.co, then pass --hf_token or set "
                         f"HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id} not found (or private: pass --hf_token or set HF_TOKEN)") from None
    except Exception as e:  # network, disk or HTTP failure: any of them ends the download the same way
        raise ValueError(f"downloading {repo_id} failed: {cli.first_line(e)}") from None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Download a Hugging Face Llama checkpoint for conversion.")
    parser.add_argument("--repo_id", required=True, help="model repo on huggingface.co, e.g. meta-llama/Llama-2-7b-hf")
    parser.add_argument("--out_dir", type=Path, default=None, help="where to put the files (default: checkpoints/<repo_id>)")
    parser.add_argument("--hf_token", default=None,
                        help="access token for gated or private repos (default: the HF_TOKEN environment variable)")
    return cli.one_line_errors(parser).parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out_dir = args.out_dir or Path("checkpoints") / args.repo_id
    download(args.repo_id, out_dir, args.hf_token or os.environ.get("HF_TOKEN"))
    print(f"downloaded {args.repo_id} to {out_dir}")


if __name__ == "__main__":
    cli.run_main(main)
