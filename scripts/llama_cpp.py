"""llama.cpp as a peer for scripts/bench.py and scripts/bench_engine.py: its llama-bench, llama-quantize and
llama-server, built once from the llama.cpp sources that the llama-cpp-python package vendors (pip fetches the
source package; cmake builds for this CPU), and the same checkpoint written as a GGUF file, in BF16 and quantized by
llama-quantize to Q8_0 and Q4_0.

    python scripts/llama_cpp.py --checkpoint checkpoints/stdlib-target --out stdlib.gguf

writes a checkpoint as a BF16 GGUF file that llama.cpp runs (a SentencePiece tokenizer goes in with it)."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import cli  # noqa: E402
from checkpoint import read_checkpoint  # noqa: E402
from cpu_gemv import CACHE  # noqa: E402

TOOLS = ("llama-bench", "llama-quantize", "llama-server")
# our weight format -> the llama.cpp type it is compared with: the same bits per weight, give or take the scales
QUANT = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}


# ---- building llama.cpp --------------------------------------------------------------------------------------------

def build_llama_cpp(where: Path = CACHE / "llama.cpp", log=print) -> Path:
    """The folder holding llama-bench, llama-quantize and llama-server: built once (about 10 minutes on 2 cores) from
    the llama-cpp-python source package, statically linked and for this CPU's instruction set (GGML_NATIVE). A tool
    that is missing is built alone, from the same package version as the others when the folder names it."""
    missing = [t for t in TOOLS if not (where / t).is_file()]
    if not missing:
        return where
    for tool in ("cmake", os.environ.get("CXX", "g++")):
        if shutil.which(tool) is None:
            raise ValueError(f"building llama.cpp needs {tool}, which is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        sdist = fetch_source(where, Path(tmp), log)
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        log(f"llama.cpp: building {' and '.join(missing)} from {sdist.name} (once; about 10 minutes on 2 cores)")
        ninja = ["-G", "Ninja"] if shutil.which("ninja") else []
        run = lambda *a: subprocess.run(a, check=True, capture_output=True, text=True, cwd=src)  # noqa: E731
        run("cmake", "-B", "build", *ninja, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON")
        run("cmake", "--build", "build", "--config", "Release", "-j", str(os.cpu_count() or 1), "--target", *missing)
        where.mkdir(parents=True, exist_ok=True)
        for t in missing:  # copied then renamed: a reader never finds half a binary
            shutil.copy2(src / "build" / "bin" / t, where / f".{t}.tmp")
            os.replace(where / f".{t}.tmp", where / t)
        (where / "VERSION").write_text(sdist.name + "\n")
    return where


def fetch_source(where: Path, tmp: Path, log) -> Path:
    """The llama-cpp-python source package, unpacked in tmp: the version the tools in `where` were built from when
    it says (so that tools built apart match), else the newest."""
    built = (where / "VERSION").read_text().strip() if (where / "VERSION").is_file() else ""
    release = built.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    package = "llama-cpp-python" + (f"=={release}" if built.startswith("llama_cpp_python-") and release else "")
    log(f"llama.cpp: fetching the source package {package}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(tmp),
                    package], check=True, capture_output=True, text=True)
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    return sdist


def version(tools: Path) -> str:
    """The source package a build here came from, or what its llama-bench (or llama-server) says of itself."""
    if (tools / "VERSION").is_file():
        return (tools / "VERSION").read_text().strip()
    tool = next((tools / t for t in TOOLS if (tools / t).is_file()), None)
    done = subprocess.run([str(tool), "--version"], capture_output=True, text=True) if tool else None
    return (done.stdout + done.stderr).strip().splitlines()[0] if done and done.returncode == 0 else "unknown"


# ---- the checkpoint as GGUF ----------------------------------------------------------------------------------------

def spm_vocab(checkpoint_dir: Path, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece tokenizer's pieces, scores and types (sentencepiece's type numbers are GGUF's), padded with
    unused entries up to the model's vocabulary."""
    import sentencepiece
    path = checkpoint_dir / "tokenizer.model"
    if not path.is_file():
        raise ValueError(f"{checkpoint_dir} has no tokenizer.model: only SentencePiece tokenizers are written to GGUF")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    n = sp.vocab_size()
    if n > vocab_size:
        raise ValueError(f"{path} has {n} pieces, more than the model's vocabulary of {vocab_size}")
    T = gguf.TokenType
    kind = lambda i: (T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i) else  # noqa: E731
                      T.BYTE if sp.is_byte(i) else T.UNUSED if sp.is_unused(i) else T.NORMAL)
    pieces = [sp.id_to_piece(i) for i in range(n)] + [f"<unused{i}>" for i in range(n, vocab_size)]
    scores = [sp.get_score(i) for i in range(n)] + [-1e9] * (vocab_size - n)
    types = [int(kind(i)) for i in range(n)] + [int(T.UNUSED)] * (vocab_size - n)
    return pieces, scores, types


def write_gguf(checkpoint_dir: Path, out: Path) -> Path:
    """The bf16 checkpoint as a BF16 GGUF of llama.cpp's "llama" architecture, whose RoPE rotates interleaved pairs
    as model.py does, so q and k go in unpermuted; the fused wqkv is split into llama.cpp's three tensors."""
    args, quantization, state = read_checkpoint(checkpoint_dir, "cpu", torch.bfloat16)
    if quantization or args.qkv_bias or args.sliding_window or args.rope_scaling:
        raise ValueError(f"{checkpoint_dir}: only bf16 checkpoints of the plain Llama layout are written to GGUF")
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(args.block_size)
    w.add_embedding_length(args.dim)
    w.add_block_count(args.n_layer)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.n_head)
    w.add_head_count_kv(args.n_kv_head)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_dimension_count(args.head_dim)
    w.add_rope_freq_base(args.rope_base)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_vocab_size(args.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    pieces, scores, types = spm_vocab(checkpoint_dir, args.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def put(name: str, t: torch.Tensor):  # bf16 as raw bytes: numpy has no bf16
        if t.dim() == 1:
            w.add_tensor(name, t.float().numpy())
        else:
            w.add_tensor(name, t.contiguous().view(torch.uint8).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
    put("token_embd.weight", state["tok_embeddings.weight"])
    q, kv = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    for i in range(args.n_layer):
        p = f"layers.{i}."
        for name, t in zip(("attn_q", "attn_k", "attn_v"), state[p + "attention.wqkv.weight"].split([q, kv, kv])):
            put(f"blk.{i}.{name}.weight", t)
        for ours, theirs in (("attention.wo", "attn_output"), ("feed_forward.w1", "ffn_gate"),
                             ("feed_forward.w3", "ffn_up"), ("feed_forward.w2", "ffn_down"),
                             ("attention_norm", "attn_norm"), ("ffn_norm", "ffn_norm")):
            put(f"blk.{i}.{theirs}.weight", state[f"{p}{ours}.weight"])
    put("output_norm.weight", state["norm.weight"])
    if not args.tie_embeddings:
        put("output.weight", state["output.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama_gguf(tools: Path, checkpoint_dir: Path, weights: str, work: Path) -> Path:
    """The checkpoint as GGUF for a weight format of ours: BF16, or Q8_0 / Q4_0 from it by llama-quantize --pure
    (every matrix in that type, the output head too, as our int8 and int4 checkpoints have it). Cached in work."""
    path = work / f"{checkpoint_dir.name}-{QUANT[weights]}.gguf"
    if path.exists():
        return path
    bf16 = work / f"{checkpoint_dir.name}-BF16.gguf"
    if not bf16.exists():
        write_gguf(checkpoint_dir, bf16.with_suffix(".tmp"))
        os.replace(bf16.with_suffix(".tmp"), bf16)
    if weights != "bf16":
        quantize_gguf(tools, bf16, path, QUANT[weights])
    return path


def quantize_gguf(tools: Path, source: Path, out: Path, kind: str) -> Path:
    """A GGUF file in the llama.cpp type `kind` by llama-quantize --pure (every matrix in that type, the output head
    too); a source that is quantized already is dequantized first (--allow-requantize), as our converter does."""
    tmp = out.with_suffix(".tmp")
    done = subprocess.run([str(tools / "llama-quantize"), "--allow-requantize", "--pure", str(source), str(tmp), kind],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = ((done.stderr + done.stdout).strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ValueError(f"llama-quantize failed on {source.name}: {last}")
    os.replace(tmp, out)
    return out


# ---- measuring -----------------------------------------------------------------------------------------------------

def llama_bench(tools: Path, model: Path, threads: int, prompt: int = 0, new_tokens: int = 0, depth: int = 0,
                repeats: int = 1, warmup: bool = True, kv_q8: bool = False) -> dict:
    """llama-bench's mean tokens/s: {"prefill": pp<prompt>, "decode": tg<new_tokens>} (at `depth` tokens of context
    when given: llama-bench prefills them first, untimed), after its own warm-up run unless warmup is False.
    kv_q8: its KV cache in Q8_0 (which needs its flash attention) instead of F16."""
    cmd = [str(tools / "llama-bench"), "-m", str(model), "-t", str(threads), "-r", str(repeats), "-o", "json",
           "-p", str(prompt), "-n", str(new_tokens), "-d", str(depth), *([] if warmup else ["--no-warmup"]),
           *(["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"] if kv_q8 else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ValueError(f"llama-bench failed on {model.name}: {last}")
    out = {}
    for test in json.loads(done.stdout):
        out["prefill" if test["n_prompt"] else "decode"] = test["avg_ts"]
    return out


def main():
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--checkpoint", type=Path, required=True, help="a bf16 checkpoint folder with a tokenizer.model")
    p.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    args = cli.one_line_errors(p).parse_args()
    cli.check_output_file(args.out, "--out", "GGUF")
    cli.write_file(args.out, lambda tmp: write_gguf(args.checkpoint, tmp))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    cli.run_main(main)
