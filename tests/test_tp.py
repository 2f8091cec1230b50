"""tp.py: tensor parallelism over torch.distributed, checked with 2 CPU processes on gloo, and with one GPU on NCCL
where there is one."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tp
from conftest import convert, errors_of, save_hf_llama
from checkpoint import load_model, read_config, read_weights
from generate import generate

ROOT = Path(__file__).resolve().parent.parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = [1, 17, 42, 99, 7, 120, 5]


def torchrun(n: int, *args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, sp_model_path):
    """4 heads, 2 KV heads and a feed-forward of 128: halves hold whole int4 groups of 32."""
    hf = tmp_path_factory.mktemp("hf_tp")
    save_hf_llama(hf, sp_model_path, intermediate_size=128)
    return convert(hf, tmp_path_factory.mktemp("tp") / "ckpt")


@pytest.fixture(scope="module", params=["float32", "int8", "int4"])
def variant(request, ckpt, tmp_path_factory):
    if request.param == "float32":
        return ckpt
    from quantize_checkpoint import quantize_checkpoint
    return quantize_checkpoint(ckpt, request.param, 32, out_dir=tmp_path_factory.mktemp("q") / request.param)


@pytest.mark.parametrize("ranks, device", [(2, "cpu"), pytest.param(1, "cuda", marks=cuda)],
                         ids=["gloo", "nccl"])
def test_ranks_give_the_single_process_logits_and_tokens(variant, tmp_path, ranks, device):
    result = torchrun(ranks, ROOT / "tests" / "tp_worker.py", variant, tmp_path, device)
    assert result.returncode == 0, result.stderr[:3000]  # the head holds the ranks' own messages
    single = load_model(variant, device, torch.float32)
    single.setup_caches(1, 64)
    with torch.no_grad():
        expected = single(torch.tensor([PROMPT], device=device), single.context(torch.arange(len(PROMPT), device=device)))[0]
    torch.testing.assert_close(load_file(tmp_path / "logits.safetensors")["logits"], expected.cpu(), rtol=1e-5,
                               atol=1e-5)
    assert json.loads((tmp_path / "tokens.json").read_text()) == generate(single, [PROMPT], 20, temperature=0).rows[0]


def test_shards_of_all_ranks_reassemble_the_checkpoint(ckpt):
    state, args = read_weights(ckpt / "model.safetensors", "cpu", torch.float32), read_config(ckpt)
    shards = [tp.shard_state(state, args, r, 2, "cpu") for r in range(2)]
    qkv = [args.n_head * args.head_dim, args.n_kv_head * args.head_dim, args.n_kv_head * args.head_dim]
    wqkv = [s["layers.0.attention.wqkv.weight"].split([n // 2 for n in qkv]) for s in shards]
    full = torch.cat([torch.cat([wqkv[0][i], wqkv[1][i]]) for i in range(3)])  # q of both, then k, then v
    assert torch.equal(full, state["layers.0.attention.wqkv.weight"])
    assert torch.equal(torch.cat([s["layers.0.feed_forward.w1.weight"] for s in shards]),
                       state["layers.0.feed_forward.w1.weight"])
    assert torch.equal(torch.cat([s["layers.0.feed_forward.w2.weight"] for s in shards], 1),
                       state["layers.0.feed_forward.w2.weight"])
    assert torch.equal(shards[1]["tok_embeddings.weight"], state["tok_embeddings.weight"])  # replicated


def test_a_model_that_does_not_split_evenly_is_refused(ckpt):
    with pytest.raises(ValueError, match="n_head 4 is not divisible by the world size 3"):
        tp.local_args(read_config(ckpt), 3)
    with pytest.raises(ValueError, match="int4 group size 128"):  # each rank's w2 would hold 64 of a group's 128
        tp.local_args(read_config(ckpt), 2, groupsize=128)


# ---- under torchrun, from the command line ------------------------------------------------------------------------

def single_greedy(ckpt, n: int) -> list[int]:  # what one process generates from the default prompt
    from tokenizer import Tokenizer
    prompt = Tokenizer(ckpt / "tokenizer.model").encode("def fibonacci(n):", bos=True)
    return generate(load_model(ckpt, "cpu", torch.float32), [prompt], n, temperature=0).rows[0]


def test_cli_compiled_two_ranks_match_one_process_and_only_rank_0_prints(ckpt, tmp_path):
    out = tmp_path / "m.json"
    result = torchrun(2, "tp.py", "--checkpoint_path", ckpt, "--device", "cpu", "--temperature", 0,
                      "--max_new_tokens", 12, "--ignore_eos", "--dtype", "float32", "--compile", "--metrics_json", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("Sample 1/1") == 1 and "GB per rank" in result.stdout
    metrics = json.loads(out.read_text())
    assert len(metrics["peak_memory_gb_per_rank"]) == 2
    assert metrics["samples"][0]["tokens"] == single_greedy(ckpt, 12)


@cuda
def test_cli_compiled_on_one_gpu_over_nccl_matches_one_process(ckpt, tmp_path):
    """The all-reduce is a functional collective: NCCL's call is captured in the decode step's CUDA graph."""
    out = tmp_path / "m.json"
    result = torchrun(1, "tp.py", "--checkpoint_path", ckpt, "--device", "cuda", "--temperature", 0,
                      "--max_new_tokens", 12, "--ignore_eos", "--dtype", "float32", "--compile", "--metrics_json", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["samples"][0]["tokens"] == single_greedy(ckpt, 12)


@cuda
def test_cli_more_ranks_than_gpus_is_refused_on_every_rank(ckpt):
    n = torch.cuda.device_count() + 1
    result = torchrun(n, "tp.py", "--checkpoint_path", ckpt, "--device", "cuda", timeout=120)
    assert result.returncode != 0
    assert f"but this machine has {n - 1}" in result.stderr


def test_cli_speculative_decoding_with_a_replicated_draft(ckpt, tmp_path, sp_model_path):
    hf = tmp_path / "hf"
    save_hf_llama(hf, sp_model_path, seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    draft = convert(hf, tmp_path / "draft")
    out = tmp_path / "m.json"
    result = torchrun(2, "tp.py", "--checkpoint_path", ckpt, "--device", "cpu", "--draft_checkpoint_path", draft,
                      "--temperature", 0, "--max_new_tokens", 16, "--ignore_eos", "--dtype", "float32",
                      "--metrics_json", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["samples"][0]["tokens"] == single_greedy(ckpt, 16)


def test_cli_under_torchrun_a_world_size_that_does_not_divide_the_heads_is_said_once(ckpt):
    result = torchrun(3, "tp.py", "--checkpoint_path", ckpt, "--device", "cpu", timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("error: n_head 4 is not divisible by the world size 3") == 1  # rank 0's


def test_cli_launched_with_ranks_refuses_a_split_before_starting_them_in_one_line(ckpt):
    result = subprocess.run([sys.executable, "tp.py", "--ranks", "3", "--checkpoint_path", str(ckpt), "--device",
                             "cpu"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert errors_of(result.stderr) == ["error: n_head 4 is not divisible by the world size 3"]


def test_cli_launched_with_ranks_runs_them_under_torchrun(ckpt, tmp_path):
    out = tmp_path / "m.json"
    result = subprocess.run([sys.executable, "tp.py", "--ranks", "2", "--checkpoint_path", str(ckpt), "--device",
                             "cpu", "--temperature", "0", "--max_new_tokens", "16", "--metrics_json", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["samples"][0]["tokens"] == single_greedy(ckpt, 16)


def test_when_a_rank_dies_the_other_exits_with_one_line(ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "tp.py", "--checkpoint_path", str(ckpt), "--device", "cpu", "--max_new_tokens", "200",
           "--ignore_eos", "--num_samples", "1000"]
    ranks = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                              stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL)
             for r in range(2)]
    try:
        assert "Loaded" in ranks[0].stdout.readline()  # both ranks are up and generating
        time.sleep(1)
        ranks[1].send_signal(signal.SIGKILL)
        _, err = ranks[0].communicate(timeout=tp.TIMEOUT.total_seconds() + 120)  # (a hang fails here)
        assert ranks[0].returncode != 0
        lines = errors_of(err)
        assert len(lines) == 1 and lines[0].startswith("error: rank 0 lost contact"), err
    finally:
        for p in ranks:
            p.kill()
