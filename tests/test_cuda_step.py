"""cuda_step.py: the engine's decode step at fixed shapes, rows padded to a ladder of batch sizes, recorded as CUDA
graphs on a GPU. On a CPU the same fixed-shape step runs unrecorded, which checks the padding and the spare block."""
import pytest
import torch

from cuda_step import Graphs, ladder
from engine import Engine, Request
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
        engine.add(Request(p, max_new_tokens=30))
    for _ in range(8):
        engine.step()
    assert len(engine.running) == rows and all(engine.decoding(r) for r in engine.running)
    return engine


def test_a_padded_fixed_shape_step_gives_each_row_the_logits_of_the_engines_own_step():
    model = tiny()
    engine = decoding_engine(model, 3)  # padded to 4
    rows = engine.running
    with torch.inference_mode():
        want = engine.forward(rows, [r.tokens[-1:] for r in rows], last=False)[:, -1]  # [3, V]
    graphs = Graphs(model, engine.cache, max_rows=8, context=engine.context, record=False)
    got = graphs.decode([r.tokens[-1] for r in rows], [r.computed for r in rows], [r.blocks for r in rows])
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_padding_rows_write_the_spare_block_and_no_other():
    model = tiny()
    engine = decoding_engine(model, 3)
    rows, spare = engine.running, engine.cache.spare
    with torch.inference_mode():  # the rows' own K and V written once already
        engine.forward(rows, [r.tokens[-1:] for r in rows], last=False)
    before = [t.clone() for t in engine.cache.k + engine.cache.v]
    graphs = Graphs(model, engine.cache, max_rows=8, context=engine.context, record=False)
    graphs.decode([r.tokens[-1] for r in rows], [r.computed for r in rows], [r.blocks for r in rows])
    after, size = engine.cache.k + engine.cache.v, engine.pool.block_size
    mine = torch.zeros(spare + 1, size, dtype=torch.bool)  # the slots of the rows' new tokens: written again
    for r in rows:
        mine[r.blocks[r.computed // size], r.computed % size] = True
    for a, b in zip(after, before):  # [blocks, Hkv, size, D]
        a, b = a.transpose(1, 2), b.transpose(1, 2)  # [blocks, size, Hkv, D]
        assert torch.equal(a[:spare][~mine[:spare]], b[:spare][~mine[:spare]])  # nothing else in the pool moved
        assert torch.allclose(a[mine], b[mine], rtol=1e-5, atol=1e-6)  # (a batch of 4 rounds as one of 3 nearly)
    assert any(not torch.equal(a[spare], b[spare]) for a, b in zip(after, before))  # the padding's token 0


@needs_cuda
def test_on_a_gpu_decode_steps_replay_cuda_graphs_and_give_each_request_its_tokens_alone():
    model = tiny(dim=64).to("cuda")  # heads of 16 dimensions: the paged kernel's least
    ps = prompts(5, 6, 5, 60)
    want = [alone(model, p, 20) for p in ps]
    engine = Engine(model, blocks=200, block_size=16, max_rows=4)
    assert engine.graphs is not None and sorted(engine.graphs.graphs) == [1, 2, 4]
    done = engine.run([Request(p, max_new_tokens=20) for p in ps])
    assert [r.out for r in done] == want and pool_is_whole(engine)
