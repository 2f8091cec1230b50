"""The paged KV cache: one pool of fixed-size blocks shared by every sequence, each sequence a table of block ids,
so that memory follows the tokens held rather than batch x max_seq_length (PagedAttention, Kwon et al. 2023).

A full block is known by its content: a hash of its tokens and of the hash of the block before it, so the same
prefix (a system prompt, a few-shot header) maps to the same blocks in every request that starts with it, and is
prefilled once. Blocks count their users; an unused block keeps its content, ready to be shared again, until the
pool needs the room (least recently released first)."""
from collections import OrderedDict, deque
from typing import Optional

import torch
from torch import Tensor

from model import Context


class BlockPool:
    """Block bookkeeping, no tensors: reference counts, content hashes and the free and cached lists."""

    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"the pool needs at least one block of at least one token, got {n_blocks} x {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.refs = [0] * n_blocks
        self.keys: list[Optional[tuple]] = [None] * n_blocks  # a full block's (hash, parent hash, tokens)
        self.by_hash: dict[int, int] = {}  # content hash -> the block holding it
        self.free = deque(range(n_blocks))  # blocks without content
        self.cached: OrderedDict = OrderedDict()  # unused blocks that keep their content, least recently released first

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def in_use(self) -> int:
        return self.n_blocks - self.available()

    def take(self) -> int:
        """A block for new content: a free one, else the least recently released cached one (its content goes)."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.by_hash[self.keys[block][0]]
            self.keys[block] = None
        else:
            raise RuntimeError("the KV pool is out of blocks")  # the scheduler checks available() first
        self.refs[block] = 1
        return block

    def find(self, h: int, parent: int, tokens: tuple) -> Optional[int]:
        """The block holding these tokens after that prefix, now one more user's, or None."""
        block = self.by_hash.get(h)
        if block is None or self.keys[block][1:] != (parent, tokens):  # a hash collision is a miss, not a mix-up
            return None
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1
        return block

    def register(self, block: int, h: int, parent: int, tokens: tuple):
        """Block is full with tokens: others may share it from now on (unless a block with them exists already)."""
        if h not in self.by_hash and self.keys[block] is None:
            self.by_hash[h], self.keys[block] = block, (h, parent, tokens)

    def release(self, blocks: list[int]):
        """One user fewer for each block; the last blocks of a sequence go first, so its head stays cached longest."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.keys[block] is None:
                    self.free.append(block)
                else:
                    self.cached[block] = None


def block_hash(parent: int, tokens: tuple) -> int:
    return hash((parent, tokens))


class PagedCache:
    """The pool's tensors, k and v [n_blocks + 1, n_kv_head, block_size, head_dim] for every layer, and the per-layer
    views (PagedLayer) that a forward pass attends through (model.Context's caches)."""

    def __init__(self, model, pool: BlockPool, dtype: Optional[torch.dtype] = None, attend=None):
        a, w = model.args, model.norm.weight
        # one block past the pool's, which no request ever holds: where a batch's padding rows write (cuda_step.py)
        self.spare = pool.n_blocks
        shape = (pool.n_blocks + 1, a.n_kv_head, pool.block_size, a.head_dim)
        with torch.inference_mode(False):  # written in place by every later step
            self.k = [torch.zeros(shape, dtype=dtype or w.dtype, device=w.device) for _ in range(a.n_layer)]
            self.v = [torch.zeros(shape, dtype=dtype or w.dtype, device=w.device) for _ in range(a.n_layer)]
        # attend(q, k_pool, v_pool, table, pos, slots) -> [B, H, S, D]: attention for a few rows straight over the
        # pool (cpu_gemv.attend_paged), which spares the gather; None: gather, and the model's own attention
        self.pool, self.model, self.attend = pool, model, attend
        # where every layer gathers its rows' blocks, one layer at a time: laid out as the static cache is (its
        # slots apart per head), so that the attention kernels split each row's context as they split a lone
        # sequence's, and round as they do
        rows = [torch.empty(0, 0, 0, 0, dtype=self.k[0].dtype, device=w.device) for _ in range(2)]
        self.layers = [PagedLayer(k, v, rows, attend, model.cache_type.sdpa, model.max_seq_length + 1)
                       for k, v in zip(self.k, self.v)]

    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.k + self.v)

    def forward(self, idx: Tensor, slots: Tensor, pos: Tensor, table: Tensor, mask: Tensor, last: bool) -> Tensor:
        """model's forward for rows that each continue their own sequence: idx, slots (where each token's K and V
        go: block * block_size + offset) and pos (its RoPE position) [B, S]; table [B, blocks] the blocks each row
        reads, in order; mask [B, S, blocks * block_size] the slots of those each token sees. -> logits [B, S|1, V]"""
        return self.model(idx, Context(pos, slots, mask[:, None], self.layers, table, last))


class PagedLayer:
    """One layer's pool, attended as model.py's KVCache is: attend writes the new tokens' K and V at their slots,
    then attends over each row's blocks (ctx.table), straight over the pool through the kernel for a few query
    rows, else gathered end to end as a static cache lays them out, past blocks * block_size finite leftovers,
    masked. sdpa: the model's attention over such a gather; slots: the static cache's length, spare slot included."""

    def __init__(self, k: Tensor, v: Tensor, rows: list[Tensor], kernel, sdpa, slots: int):
        self.k, self.v, self.rows, self.kernel, self.sdpa, self.slots = k, v, rows, kernel, sdpa, slots

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> Tensor:  # q [B, H, S, D], k/v [B, Hkv, S, D]
        size = self.k.size(2)
        block, offset = (ctx.slots // size).flatten(), (ctx.slots % size).flatten()
        for pool, new in ((self.k, k), (self.v, v)):
            pool[block, :, offset] = new.transpose(1, 2).flatten(0, 1).to(pool.dtype)  # [B * S, Hkv, D]
        if self.kernel is not None and q.size(2) <= 32:  # the kernel's rows: decode steps, short chunks
            return self.kernel(q, self.k, self.v, ctx.table, ctx.pos, self.slots)
        (B, n), (_, H, _, D), held = ctx.table.shape, self.k.shape, []
        for i, pool in enumerate((self.k, self.v)):
            if self.rows[i].size(0) < B or self.rows[i].size(2) < n * size:  # [B, Hkv, slots, D], grown as needed
                slots = max(n * size, self.rows[i].size(2), self.slots)
                grown = max(B, 2 * self.rows[i].size(0))  # doubling: a batch that grows a row a step reallocates rarely
                self.rows[i] = torch.zeros(grown, H, slots, D, dtype=pool.dtype, device=pool.device)  # finite
            self.rows[i][:B, :, : n * size].view(B, H, n, size, D).copy_(pool[ctx.table].transpose(1, 2))
            held.append(self.rows[i][:B, :, : ctx.mask.size(-1)])  # as many slots as the mask covers
        return self.sdpa(q, *held, attn_mask=ctx.mask, enable_gqa=q.size(1) != k.size(1))
