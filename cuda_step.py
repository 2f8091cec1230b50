"""The engine's decode step on a GPU as CUDA graphs: the decoding rows' whole forward pass over the paged cache,
recorded once for each batch size of a ladder (1, 2, 4, 8, then steps of 8 up to the engine's rows) and replayed
with a step's rows padded to the next size. A step is then one launch and a few small copies, with no Python
between the layers: what generate.py's compiled step gives one sequence, for a batch that changes every step.

Everything a recording reads has a fixed place and shape: the tokens, positions, slots and block tables of the
largest size, of which a smaller size uses the first rows; each row's table as wide as the context. Padded rows
decode token 0 at position 0 into the pool's spare block, which no request ever holds, and their logits are
dropped. Attention reads each row's blocks where they lie (cuda_gemv.attend_paged), whatever the context."""
from typing import Optional

import torch
from torch import Tensor


def ladder(max_rows: int) -> list[int]:
    """The batch sizes recorded: 1, 2, 4, 8, then every multiple of 8, up to max_rows (and it)."""
    sizes = [n for n in (1, 2, 4) if n < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows]


class Graphs:
    """Decode steps of up to max_rows rows over cache (paged.PagedCache, whose spare block the padded rows write),
    for a context of `context` tokens. record=False runs the same fixed-shape step without recording it (a CPU, or
    a check of the padding); the logits are the same."""

    def __init__(self, model, cache, max_rows: int, context: int, record: bool = True):
        device, size = model.norm.weight.device, cache.pool.block_size
        self.cache, self.size, self.sizes = cache, size, ladder(max_rows)
        n, width = self.sizes[-1], -(-context // size)

        def fixed(fill, *shape, dtype=torch.long):
            return torch.full(shape, fill, dtype=dtype, device=device)
        self.tokens, self.pos = fixed(0, n, 1), fixed(0, n, 1)  # [n, 1]
        self.slots = fixed(cache.spare * size, n, 1)  # [n, 1]: block * size + offset
        self.table = fixed(cache.spare, n, width)  # [n, width]
        self.mask = fixed(False, n, 1, width * size, dtype=torch.bool)  # [n, 1, width * size]
        self.logits = fixed(0, n, model.args.vocab_size, dtype=torch.float32)  # [n, V]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if record:
            self.record()

    @torch.inference_mode()
    def run(self, b: int):
        """The fixed-shape step of the first b rows: their logits into self.logits[:b]."""
        torch.le(torch.arange(self.mask.size(-1), device=self.pos.device), self.pos[:b, :, None], out=self.mask[:b])
        out = self.cache.forward(self.tokens[:b], self.slots[:b], self.pos[:b], self.table[:b], self.mask[:b],
                                 last=False)  # [b, 1, V]
        self.logits[:b].copy_(out[:, -1])

    def record(self):
        """One CUDA graph per size, largest first, all in one memory pool: each run once before it is recorded
        (the kernels' autotuning and cuBLAS's workspace happen outside the recording)."""
        pool, stream = None, torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self.run(b)
        torch.cuda.current_stream().wait_stream(stream)
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.run(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def decode(self, tokens: list[int], pos: list[int], tables: list[list[int]]) -> Tensor:
        """The logits [B, V] of B rows that each add one token (tokens[i] at position pos[i], its blocks
        tables[i]): written into the fixed places, the rest of the size's rows padding, then replayed. Only the
        tables' first columns are written, as many as the longest holds: what lies past a row's last block is never
        attended (masked where the rows are gathered), whatever an earlier step left there."""
        B, spare, used = len(tokens), self.cache.spare, max(len(t) for t in tables)
        b = next(n for n in self.sizes if n >= B)
        slots = [t[p // self.size] * self.size + p % self.size for t, p in zip(tables, pos)]
        pad = b - B
        rows = torch.tensor([[t, p, s] for t, p, s in zip(tokens, pos, slots)] + [[0, 0, spare * self.size]] * pad)
        table = torch.tensor([t + [spare] * (used - len(t)) for t in tables] + [[spare] * used] * pad)  # [b, used]
        self.tokens[:b].copy_(rows[:, :1], non_blocking=True)
        self.pos[:b].copy_(rows[:, 1:2], non_blocking=True)
        self.slots[:b].copy_(rows[:, 2:], non_blocking=True)
        self.table[:b, :used].copy_(table, non_blocking=True)
        graph: Optional[torch.cuda.CUDAGraph] = self.graphs.get(b)
        graph.replay() if graph is not None else self.run(b)
        return self.logits[:B]
