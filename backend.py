"""Which implementation runs a model's forward passes, chosen once, in one place, for every decoding loop and for
the engine (Paged, at the end).

A Backend has the same few methods whatever runs underneath: prefill (a prompt), decode (each row's next tokens),
verify (a speculative pass over a few positions, a token tree's mask and positions included), greedy (decode's
argmax) and greedy_loop (a whole greedy answer in one call, where it can). Each returns logits; the loops draw
their tokens from those with sampling.pick, one rule for all.

Underneath, in this order:
- on a CPU with the kernels of cpu_gemv.py, a batch of one runs on the C++ step of cpu_step.py: decoding as one C++
  call a token, verify passes as its rows, prompts as its rows a piece at a time. Its kernels compute each position
  as alone, so an answer is the same however its prompt is cut into passes, and the same as the engine's;
- everything else (batches, left padding, GPUs, torch's own kernels) runs model.py's forward, compiled by
  torch.compile where asked: CUDA graphs on a GPU, inductor's C++ wrapper on a CPU."""
from typing import Callable, Optional

import torch
from torch import Tensor

from sampling import NOT_FINITE



def last_logits(model, idx, input_pos, left_pad, kv_len):  # idx [B, S], input_pos [S] -> [B, V]
    return model(idx, model.context(input_pos, left_pad, kv_len, last=True))[:, -1]


def all_logits(model, idx, input_pos, kv_len, mask, pos):  # idx [1, S] -> [S, V]
    return model(idx, model.context(input_pos, None, kv_len, mask, pos))[0]


def compile_step(step: Callable) -> Callable:
    """Compile a step whole: CUDA graphs on a GPU, inductor's C++ wrapper on a CPU, each option cutting the fixed
    cost a CPU step pays (HOW_IT_WORKS.md, "The compiled step on a CPU"). dynamic: one compilation serves every
    cache length and verify length."""
    # fewer guards to check per step (an unchanged module passes in one check), floats such as eps as constants
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True  # set where compilation is asked for, not on
    torch._dynamo.config.specialize_float = True  # import: lazy compilation reads them at the first call
    on_cpu = torch.compile(step, fullgraph=True, dynamic=True, options={
        "cpp_wrapper": True, "cpp_wrapper_build_separate": True,  # no Python per step; kernels and wrapper build apart
        "size_asserts": False, "alignment_asserts": False,  # no per-tensor checks every step
        "cpp.min_chunk_size": 16384})  # a batch-1 step's norms and RoPE on one thread: too small to split
    if not torch.cuda.is_available():
        return on_cpu
    # tunes the reductions inductor writes itself: the norms, and any batch-1 matmul not on cuda_gemv.py's kernels
    torch._inductor.config.coordinate_descent_tuning = True
    on_gpu = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=True)

    def run(*args, **kwargs):  # a model on the CPU of a GPU machine keeps the CPU's options
        x = next(a for a in args if isinstance(a, torch.Tensor))
        return (on_gpu if x.is_cuda else on_cpu)(*args, **kwargs)
    return run


class Backend:
    """model's forward passes, on the fastest exact implementation here (see the module's text). compile: the
    passes model.py runs go through torch.compile (the first call compiles); compile_prefill: prompts too, with
    dynamic shapes. cpp=False: never the C++ step (model.py's forward alone, a reference)."""

    def __init__(self, model, compile: bool = False, compile_prefill: bool = False, cpp: bool = True):
        self.model, self.compiled, self.use_cpp = model, compile, cpp
        self.last = torch.compile(last_logits, dynamic=True, fullgraph=True) if compile_prefill else last_logits
        self.rows = compile_step(all_logits) if compile else all_logits
        self.step_last = compile_step(last_logits) if compile else last_logits  # decode's, apart from prefill's
        self.held, self.agreed = (None, None), False  # (the cache the C++ step was built over, the step or None)

    def begin(self):
        """A new answer: the C++ step is built again at its first pass, for the model as it is now (a loop may
        follow a change of weights or layers; within one nothing changes). About a millisecond."""
        self.held = (None, None)

    def cpp(self):  # -> Optional[cpu_step.Step]
        """The C++ step over the model's cache as it is now (setup_caches makes a new one), or None where it
        cannot run this model exactly; checked against model.py's forward the first time (cpu_step.agrees)."""
        m = self.model
        cache = m.layers[0].attention.kv_cache.k_cache if len(m.layers) and m.layers[0].attention.kv_cache else None
        if self.held[0] is not cache:
            import cpu_step  # here: a model that never runs on a CPU needs no kernel module
            step = cpu_step.step_for(m, verify=not self.agreed) if cache is not None and cache.device.type == "cpu" \
                else None
            self.held, self.agreed = (cache, step), self.agreed or step is not None
        return self.held[1]

    def describe(self) -> str:
        """Which implementation runs a batch of one, and why, in one line."""
        if self.cpp() is not None:
            return "the C++ step (cpu_step.py) for a batch of one; model.py's forward for batches"
        why = "torch.compile" if self.compiled else "eager"
        if self.model.norm.weight.device.type == "cpu" and self.use_cpp:
            return f"model.py's forward ({why}; the C++ step runs bfloat16 weights on the CPU kernels)"
        return f"model.py's forward ({why})"

    def alone(self, idx: Tensor, left_pad):  # -> the C++ step (cpu_step.Step) where it runs this pass, or None
        if idx.size(0) != 1 or left_pad is not None or idx.device.type != "cpu" or not self.use_cpp:
            return None
        return self.cpp()

    def prefill(self, idx: Tensor, input_pos: Tensor, left_pad=None, kv_len: Optional[int] = None) -> Tensor:
        """The logits [B, V] after a prompt (or its uncached part) idx [B, S] at cache slots input_pos [S], each row
        left-padded by left_pad [B] (or None)."""
        step = self.alone(idx, left_pad)
        if step is None or self.model.args.sliding_window:
            return self.last(self.model, idx, input_pos, left_pad, kv_len)
        return self.pieces(step, idx, input_pos, input_pos, None, last=True)

    def decode(self, cur: Tensor, input_pos: Tensor, left_pad=None, kv_len: Optional[int] = None) -> Tensor:
        """The logits [B, V] after each row's next tokens cur [B, S] at slots input_pos [S] (S > 1: tokens a grammar
        forces, fed with the sampled one). At batch 1 on the C++ step, the step's own buffer: read it before the
        next pass."""
        step = self.alone(cur, left_pad)
        if step is None:
            return self.step_last(self.model, cur, input_pos, left_pad, kv_len)
        if cur.size(1) == 1:
            return step(cur, input_pos)
        return self.verify(cur, input_pos, kv_len)[-1:]

    def greedy(self, cur: Tensor, input_pos: Tensor, left_pad=None, kv_len: Optional[int] = None) -> Tensor:
        """decode's argmax [B] (NOT_FINITE where a row's logits are not), the C++ step's in C++ where it runs."""
        step = self.alone(cur, left_pad)
        if step is not None and cur.size(1) == 1:
            return torch.tensor([step.greedy(cur, input_pos)])
        logits = self.decode(cur, input_pos, left_pad, kv_len)
        return torch.where(torch.isfinite(logits.sum(-1)), logits.argmax(-1), NOT_FINITE)

    def verify(self, tokens: Tensor, input_pos: Tensor, kv_len: Optional[int] = None, mask: Optional[Tensor] = None,
               pos: Optional[Tensor] = None) -> Tensor:
        """The logits [S, V] after each of tokens [1, S], written at slots input_pos [S]: a chain in order, or a
        token tree with mask [S, kv_len] (the slots each sees) and pos [S] (its RoPE positions)."""
        step = self.alone(tokens, None)
        if step is None or self.model.args.sliding_window:
            return self.rows(self.model, tokens, input_pos, kv_len, mask, pos)
        return self.pieces(step, tokens, input_pos, input_pos if pos is None else pos, mask)

    @staticmethod
    def pieces(step, tokens: Tensor, input_pos: Tensor, pos: Tensor, mask: Optional[Tensor], last: bool = False):
        """tokens [1, S] on the C++ step's rows, Step.piece positions a call (a prompt, a draft catching up on many
        tokens): each position computed as alone, however the tokens are cut. -> [S, V], or the last row's [1, V]."""
        S, base, out = tokens.size(1), int(input_pos[0]), []
        for i in range(0, S, step.piece):
            j = min(S, i + step.piece)
            rows = step.rows(tokens[0, i:j], pos[i:j], base + i, causal(j - i, base + i) if mask is None
                             else mask[i:j, : base + j], last)
            out.append(rows if j == S or last else rows.clone())  # (the step's buffer: the next call rewrites it)
        return out[-1] if last or len(out) == 1 else torch.cat(out)

    def greedy_loop(self, out: Tensor, pos: int, left_pad, eos: Optional[Tensor]) -> Optional[int]:  # out [B, N]
        """Greedy decoding into out[:, 1:] (out[:, 0] holds prefill's token, at slot pos) as one C++ call: the
        columns filled, or None where the C++ step does not run (or the answer ended at once)."""
        step = self.alone(out, left_pad)
        first = int(out[0, 0]) if step is not None else NOT_FINITE
        if step is None or first == NOT_FINITE or (eos is not None and first in eos.tolist()):
            return None
        return 1 + step.greedy_loop(first, pos, out[0, 1:], eos)


def causal(M: int, base: int) -> Tensor:  # -> [M, base + M]: M positions after base, each seeing its past
    return torch.ones(M, base + M, dtype=torch.bool).tril(base)


class Paged:
    """The engine's forward passes over its paged KV pool (paged.py), on the fastest exact implementation here,
    chosen once: on the CPU kernels the C++ step over the pool (a step's decoding rows and prompt chunks in one call,
    every weight read once for all of them); on a GPU with the paged attention, decode steps as CUDA graphs
    (cuda_step.py); else model.py's forward through the pool's views, attending straight over the pool where a
    kernel can (a few query rows)."""

    def __init__(self, model, pool, kv_dtype, max_rows: int):
        from paged import PagedCache
        kv_dtype = kv_dtype or model.norm.weight.dtype
        self.model, self.context = model, model.max_seq_length
        self.cache = PagedCache(model, pool, kv_dtype, attend_paged_kernel(model, pool.block_size, kv_dtype))
        self.cpp = paged_step(model, self.cache)
        self.graphs = None
        if self.cache.attend is not None and model.norm.weight.is_cuda:
            import cuda_step
            self.graphs = cuda_step.Graphs(model, self.cache, max_rows, self.context)
        self.logits = torch.empty(max_rows, model.args.vocab_size) if self.cpp is not None else None

    def describe(self) -> str:
        return ("CUDA graphs of the decode step" if self.graphs is not None else "the C++ step over the pool"
                if self.cpp is not None else "model.py's forward over the pool")

    def step(self, parts: list[tuple[list[int], int, list[int], bool]]) -> tuple[Tensor, list[Optional[Tensor]]]:
        """A step's forward passes: each part (tokens, start, blocks, every) adds its tokens from position start,
        writing their K and V into its blocks. Returns the logits after each part's last token [P, V], and for the
        parts with every those after each of its tokens [n, V] (else None). On the C++ step, in passes of
        Step.piece rows at most (a part cut where a pass is full goes on in the next, in order), each row computed
        as alone however the step is made up; its buffers are rewritten by the next step."""
        if self.cpp is None:
            return self.each(parts)
        P, V = len(parts), self.logits.size(1)
        spans, rows = [], P  # the rows of the parts with every: after the P last ones
        for tokens, _, _, every in parts:
            spans.append(rows if every else -1)
            rows += len(tokens) if every else 0
        if self.logits.size(0) < rows:
            self.logits = torch.empty(rows, V)
        batch, taken = [], 0  # one pass: (part, its first token here, count)
        for i, (tokens, start, blocks, every) in enumerate(parts):
            done = 0
            while done < len(tokens):
                n = min(len(tokens) - done, self.cpp.piece - taken)
                batch.append((i, done, n))
                taken, done = taken + n, done + n
                if taken == self.cpp.piece:
                    self.run(parts, batch, spans)
                    batch, taken = [], 0
        if batch:
            self.run(parts, batch, spans)
        last = self.logits[:P]
        return last, [self.logits[k : k + len(parts[i][0])] if k >= 0 else None for i, k in enumerate(spans)]

    def run(self, parts, batch: list[tuple[int, int, int]], spans: list[int]):
        """One C++ pass over batch's pieces of parts, each (part, first token, count): the logits of each part's
        last token to its row of self.logits, and of every token of a part with every to its span's row."""
        tokens, pos, lens, tables, out, dst = [], [], [], [], [], []
        at = 0
        for i, first, n in batch:
            chunk, start, blocks, every = parts[i]
            tokens += chunk[first : first + n]
            pos += range(start + first, start + first + n)
            lens.append(n)
            tables.append(blocks)
            if first + n == len(chunk):
                out.append(at + n - 1), dst.append(i)
            if every:
                out += range(at, at + n)
                dst += range(spans[i] + first, spans[i] + first + n)
            at += n
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [B, W]
        whole = dst == list(range(len(dst)))  # (a step in one pass: its logits land in place)
        logits = self.logits if whole else torch.empty(len(out), self.logits.size(1))
        ids = [torch.tensor(v, dtype=torch.int64) for v in (tokens, pos, lens, out)]
        self.cpp.cpp.paged(*ids[:3], table, ids[3], logits)
        if not whole:
            self.logits[dst] = logits

    def each(self, parts) -> tuple[Tensor, list[Optional[Tensor]]]:
        """step's logits on CUDA graphs or model.py's forward: the one-token parts decoded together, each chunk
        through model.py's forward on its own."""
        ones = [i for i, (tokens, _, _, every) in enumerate(parts) if len(tokens) == 1 and not every]
        last, every = [None] * len(parts), [None] * len(parts)
        if ones:
            rows = self.decode([parts[i][0][0] for i in ones], [parts[i][1] for i in ones], [parts[i][2] for i in ones])
            for k, i in enumerate(ones):
                last[i] = rows[k : k + 1]
        for i, (chunk, start, blocks, all_rows) in enumerate(parts):
            if last[i] is None:
                out = self.forward([chunk], [start], [blocks], last=not all_rows)[0]  # [S or 1, V]
                last[i], every[i] = out[-1:], out if all_rows else None
        return torch.cat(last), every

    def decode(self, tokens: list[int], pos: list[int], tables: list[list[int]]) -> Tensor:  # -> [B, V]
        """The next logits of rows that each add one token at position pos[i], reading the blocks tables[i]."""
        if self.graphs is not None:
            return self.graphs.decode(tokens, pos, tables)
        return self.forward([[t] for t in tokens], pos, tables, last=False)[:, -1]

    def forward(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]], last: bool) -> Tensor:
        """model.py's forward over rows that each add their chunk (equal lengths) from position starts[i]."""
        from model import kv_bucket
        size, device = self.cache.pool.block_size, self.model.norm.weight.device
        S, width = len(chunks[0]), max(map(len, tables))
        pos = torch.tensor([[s + j for j in range(S)] for s in starts], device=device)  # [B, S]
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)  # [B, W]
        slots = table.gather(1, pos // size) * size + pos % size  # [B, S]
        # [B, S, L]: its own past; as many slots as a lone sequence's step reads (kv_bucket), for the same rounding
        L = max(width * size, kv_bucket(int(pos.max()) + 1, self.context))
        mask = torch.arange(L, device=device) <= pos[..., None]
        return self.cache.forward(torch.tensor(chunks, device=device), slots, pos, table, mask, last)


def attend_paged_kernel(model, block_size: int, kv_dtype) -> Optional[Callable]:
    """Attention straight over the pool: cpu_gemv.attend_paged for a model on the CPU kernels (its attention is
    theirs), cuda_gemv.attend_paged on a GPU (a float cache, no sliding window); else None (the rows gathered)."""
    import cpu_gemv
    if model.cache_type is cpu_gemv.KernelCache:
        return cpu_gemv.attend_paged
    if model.norm.weight.is_cuda and kv_dtype.is_floating_point and not model.args.sliding_window:
        import cuda_gemv
        return cuda_gemv.attend_paged if cuda_gemv.pages_ok(model.args.head_dim, block_size) else None
    return None


def paged_step(model, cache):
    """The C++ decode step (cpu_step.py) over cache's pools, or None where it cannot run model exactly."""
    if cache.attend is None or model.args.sliding_window or cache.k[0].dtype != torch.bfloat16:
        return None
    import cpu_step
    step = cpu_step.step_for(model)
    if step is not None:
        step.cpp.set_pools(cache.k, cache.v)
    return step
