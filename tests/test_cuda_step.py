"""cuda_step.py: the engine's decode step at fixed shapes, rows padded to a ladder of batch sizes, recorded as CUDA
graphs on a GPU. On a CPU the same fixed-shape step runs unrecorded, which checks the padding and the spare block."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_step import Graphs, ladder
from engine import Engine, Request
from sampling import Sampling
from test_engine import alone, pool_is_whole, prompts, tiny

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_the_ladder_has_a_size_for_every_batch_up_to_the_engines_rows():
    assert ladder(1) == [1] and ladder(5) == [1, 2, 4, 5] and ladder(12) == [1, 2, 4, 8, 12]
    assert ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for rows in (1, 3, 8, 9, 64):
        assert all(any(b >= n for b in ladder(rows)) for n in range(1, rows + 1))


def decoding_engine(model, rows: int) -> Engine:
    """An engine whose `rows` requests (prompts of different lengths) are all decoding, a few tokens in."""
    engine = Engine(model, blocks=60, block_size=8, max_rows=8)
    for p in prompts(3, rows, 5, 40):
        engine.add(Request(p, Sampling(30, temperature=0)))
    for _ in range(8):
        engine.step()
    assert len(engine.running) == rows and all(engine.decoding(r) for r in engine.running)
    return engine


def forward(engine: Engine, rows: list):  # the engine's own model.py pass for rows adding their last token
    return engine.passes.forward([r.tokens[-1:] for r in rows], [r.computed for r in rows], [r.blocks for r in rows],
                                 last=False)


def test_a_padded_fixed_shape_step_gives_each_row_the_logits_of_the_engines_own_step():
    model = tiny()
    engine = decoding_engine(model, 3)  # padded to 4
    rows = engine.running
    with torch.inference_mode():
        want = forward(engine, rows)[:, -1]  # [3, V]
    graphs = Graphs(model, engine.passes.cache, max_rows=8, context=engine.context, record=False)
    got = graphs.decode([r.tokens[-1] for r in rows], [r.computed for r in rows], [r.blocks for r in rows])
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_padding_rows_write_the_spare_block_and_no_other():
    model = tiny()
    engine = decoding_engine(model, 3)
    rows, spare = engine.running, engine.passes.cache.spare
    with torch.inference_mode():  # the rows' own K and V written once already
        forward(engine, rows)
    before = [t.clone() for t in engine.passes.cache.k + engine.passes.cache.v]
    graphs = Graphs(model, engine.passes.cache, max_rows=8, context=engine.context, record=False)
    graphs.decode([r.tokens[-1] for r in rows], [r.computed for r in rows], [r.blocks for r in rows])
    after, size = engine.passes.cache.k + engine.passes.cache.v, engine.pool.block_size
    mine = torch.zeros(spare + 1, size, dtype=torch.bool)  # the slots of the rows' new tokens: written again
    for r in rows:
        mine[r.blocks[r.computed // size], r.computed % size] = True
    for a, b in zip(after, before):  # [blocks, Hkv, size, D]
        a, b = a.transpose(1, 2), b.transpose(1, 2)  # [blocks, size, Hkv, D]
        assert torch.equal(a[:spare][~mine[:spare]], b[:spare][~mine[:spare]])  # nothing else in the pool moved
        assert torch.allclose(a[mine], b[mine], rtol=1e-5, atol=1e-6)  # (a batch of 4 rounds as one of 3 nearly)
    assert any(not torch.equal(a[spare], b[spare]) for a, b in zip(after, before))  # the padding's token 0


# Runs in a child process: TRITON_INTERPRET is read when cuda_gemv defines its kernels
INTERPRETED = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import backend, cuda_gemv, engine
from cuda_step import Graphs
from sampling import Sampling
from test_engine import alone, prompts, tiny
backend.attend_paged_kernel = lambda *args: cuda_gemv.attend_paged  # the GPU's attention, on CPU tensors
model = tiny(dim=64)
ps = prompts(7, 5, 5, 60)
e = engine.Engine(model, blocks=80, block_size=16, max_rows=4, budget=40)  # 3 rows pad to 4; chunks of 40
e.passes.graphs = Graphs(model, e.passes.cache, 4, e.context, record=False)
done = e.run([engine.Request(p, Sampling(12, temperature=0)) for p in ps])
print(json.dumps([[r.out for r in done], [alone(model, p, 12) for p in ps]]))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                    reason="Triton is not installed, or a GPU runs the kernel for real")
def test_the_gpu_engine_path_in_triton_s_interpreter_gives_each_request_its_tokens_alone():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", INTERPRETED, str(root)], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got, want = json.loads(r.stdout.splitlines()[-1])
    assert got == want


@needs_cuda
def test_on_a_gpu_decode_steps_replay_cuda_graphs_and_give_each_request_its_tokens_alone():
    model = tiny(dim=64).to("cuda")  # heads of 16 dimensions: the paged kernel's least
    ps = prompts(5, 6, 5, 60)
    want = [alone(model, p, 20) for p in ps]
    engine = Engine(model, blocks=200, block_size=16, max_rows=4)
    assert engine.passes.graphs is not None and sorted(engine.passes.graphs.graphs) == [1, 2, 4]
    done = engine.run([Request(p, Sampling(20, temperature=0)) for p in ps])
    assert [r.out for r in done] == want and pool_is_whole(engine)
