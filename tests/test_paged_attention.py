"""cpu_gemv.attend_paged: decode attention for many sequences straight over paged.py's block pool. Each row comes out
bit for bit as attend() computes it for that row alone over a static cache of `slots` positions, on every kernel set
this CPU runs; without the kernel, torch's attention over the gathered blocks; bad inputs raise a clear error."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cpu_gemv
from model import kv_bucket
from test_batch_invariance import TARGETS, kernels  # noqa: F401 (a fixture: every kernel set this CPU runs)

needs_kernels = pytest.mark.skipif(not TARGETS or cpu_gemv.load() is None, reason="no kernels for this CPU or no g++")


def paged(lengths: list[int], H: int, Hkv: int, S: int, D: int, block_size: int = 16, dtype=torch.bfloat16,
          seed: int = 0):
    """q [B, H, S, D] for rows whose contexts are `lengths` long (their last S positions are the queries, causal),
    a random pool with a few blocks to spare, and each row's blocks drawn at random from it (the table's columns
    past a row's last block are -1)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    W, n_blocks = max(need), sum(need) + 3
    k_pool, v_pool = (torch.randn(n_blocks, Hkv, block_size, D, generator=g).to(dtype) for _ in range(2))
    ids, table = torch.randperm(n_blocks, generator=g).tolist(), torch.full((len(lengths), W), -1)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n])
        del ids[:n]
    pos = torch.stack([torch.arange(n - S, n) for n in lengths])  # [B, S]
    q = torch.randn(len(lengths), H, S, D, generator=g).to(dtype)
    return q, k_pool, v_pool, table, pos


def contiguous_row(k_pool: torch.Tensor, table: torch.Tensor, b: int, n: int, slots: int) -> torch.Tensor:
    """Row b's first n positions of a pool, at the same positions of a static cache [1, Hkv, slots, D]."""
    Hkv, size, D = k_pool.shape[1:]
    blocks = table[b, : -(-n // size)]
    cache = torch.zeros(1, Hkv, slots, D, dtype=k_pool.dtype)
    cache[0, :, :n] = k_pool[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :n]
    return cache


def exact(q, k_pool, v_pool, table, pos) -> torch.Tensor:
    """Attention in float64, one row, head and query at a time, reading each position from its block."""
    B, H, S, D = q.shape
    Hkv, size = k_pool.size(1), k_pool.size(2)
    out = torch.empty(B, H, S, D, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            seen = torch.arange(int(pos[b, s]) + 1)
            blocks, at = table[b, seen // size], seen % size
            for h in range(H):
                k = k_pool[blocks, h // (H // Hkv), at].double()  # [n, D]
                v = v_pool[blocks, h // (H // Hkv), at].double()
                w = torch.softmax(k @ q[b, h, s].double() / D**0.5, dim=0)
                out[b, h, s] = w @ v
    return out


# rows of several lengths: within one chunk, on a chunk's edge (256, 512), and across one or two
LENGTHS = [4, 17, 255, 256, 257, 300, 513, 700]


@needs_kernels
@pytest.mark.parametrize("slots, Hkv", [(1025, 2), (2049, 4)])  # chunks of 256, and of 512 over AVX512-BF16
@pytest.mark.parametrize("G", [2, 3])  # query heads per KV head
@pytest.mark.parametrize("S", [1, 4])
@pytest.mark.parametrize("D", [64, 128])
@torch.inference_mode()
def test_each_row_equals_attend_alone_over_a_contiguous_cache_bit_for_bit(kernels, slots, Hkv, G, S, D):
    q, k_pool, v_pool, table, pos = paged(LENGTHS, G * Hkv, Hkv, S, D, seed=slots + G + S + D)
    got = cpu_gemv.attend_paged(q, k_pool, v_pool, table, pos, slots)
    for b, n in enumerate(LENGTHS):
        k, v = contiguous_row(k_pool, table, b, n, slots), contiguous_row(v_pool, table, b, n, slots)
        L = kv_bucket(n, slots)  # what model.py gives attend for this row alone
        mask = (torch.arange(L) <= pos[b, :, None])[None, None]  # [1, 1, S, L]
        alone = torch.ops.fast_decode.attend(q[b : b + 1], k[:, :, :L], v[:, :, :L], mask)
        assert torch.equal(got[b], alone[0]), (b, n)


@needs_kernels
@pytest.mark.parametrize("D", [64, 128])
@torch.inference_mode()
def test_attend_reads_nothing_past_the_last_position_a_row_sees(kernels, D):
    """Why attend_paged may stop at the last position any row sees: attend gives the same bits whatever the cache
    holds past it, and however many positions (L) it is given beyond it, fully masked chunks included."""
    slots, n, S = 2049, 300, 4
    q, k_pool, v_pool, table, pos = paged([n], 6, 2, S, D)
    k, v = contiguous_row(k_pool, table, 0, n, slots), contiguous_row(v_pool, table, 0, n, slots)
    runs = []
    for L in (n, kv_bucket(n, slots), 1024, slots):
        mask = (torch.arange(L) <= pos[0, :, None])[None, None]
        runs.append(torch.ops.fast_decode.attend(q, k[:, :, :L], v[:, :, :L], mask))
    k[:, :, n:], v[:, :, n:] = float("nan"), float("nan")
    mask = (torch.arange(slots) <= pos[0, :, None])[None, None]
    runs.append(torch.ops.fast_decode.attend(q, k, v, mask))
    assert all(torch.equal(run, runs[0]) for run in runs)


@needs_kernels
@torch.inference_mode()
def test_a_rows_blocks_past_its_last_position_are_never_read(kernels):
    q, k_pool, v_pool, table, pos = paged([40, 300], 4, 2, 1, 64)
    assert (table[0, 3:] == -1).all()  # 40 positions: three blocks; the rest of its table is no block at all
    got = torch.ops.fast_decode.attend_paged(q, k_pool, v_pool, table, pos, 1025)
    table[0, 3:] = table[1, 3:]  # a row's unused entries may as well be another row's blocks
    assert torch.equal(torch.ops.fast_decode.attend_paged(q, k_pool, v_pool, table, pos, 1025), got)


@needs_kernels
@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@torch.inference_mode()
def test_the_kernel_is_attention_to_within_bf16_rounding(kernels, D):
    q, k_pool, v_pool, table, pos = paged([5, 100, 600], 6, 2, 4, D)
    got = torch.ops.fast_decode.attend_paged(q, k_pool, v_pool, table, pos, 1025)
    torch.testing.assert_close(got.double(), exact(q, k_pool, v_pool, table, pos), atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def test_the_fallback_is_attention_in_float32():
    q, k_pool, v_pool, table, pos = paged([5, 100, 600], 6, 2, 4, 64, dtype=torch.float32)
    got = cpu_gemv.attend_paged(q, k_pool, v_pool, table, pos, 1025)  # float32: never the kernel
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact(q, k_pool, v_pool, table, pos), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_without_the_kernels_bf16_goes_to_the_fallback(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_lib", None)
    q, k_pool, v_pool, table, pos = paged([5, 100, 300], 4, 2, 1, 64)
    got = cpu_gemv.attend_paged(q, k_pool, v_pool, table, pos, 1025)
    torch.testing.assert_close(got.double(), exact(q, k_pool, v_pool, table, pos), atol=2e-2, rtol=2e-2)


@needs_kernels
def test_the_ops_fake_gives_its_output_shape_without_running_it():
    inputs = paged([20, 40], 6, 2, 3, 64)
    with FakeTensorMode() as mode:
        got = torch.ops.fast_decode.attend_paged(*(mode.from_tensor(t) for t in inputs), 1025)
        assert got.shape == (2, 6, 3, 64) and got.dtype == torch.bfloat16


def bad(what: str):
    """paged()'s inputs for two rows, with one thing wrong."""
    S, size = (33 if what == "S" else 1), {"block 24": 24, "block 48": 48}.get(what, 16)
    q, k_pool, v_pool, table, pos = paged([40, 100], 4, 2, S, 64, block_size=size)
    if what == "dtype":
        q = q.float()
    elif what == "position":
        pos[1, 0] = 1025
    elif what == "block id":
        table[0, 1] = k_pool.size(0)
    return q, k_pool, v_pool, table, pos


@needs_kernels
@pytest.mark.parametrize("what, error", [
    ("dtype", "must be bfloat16, got Float"),
    ("block 24", "block_size must be a multiple of 16, got 24"),
    ("block 48", "block_size 48 does not divide the kernel's chunk of 256 positions"),
    ("S", "1 to 32 query positions a row"),
    ("position", "row 1 has position 1025, outside 0 .. 111"),  # 7 blocks of 16 in its table
    ("block id", "row 0's block 1 is"),
])
@torch.inference_mode()
def test_bad_inputs_raise_a_clear_error(what, error):
    with pytest.raises(RuntimeError, match=error):
        torch.ops.fast_decode.attend_paged(*bad(what), 1025)
