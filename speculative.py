"""Speculative decoding: a cheap proposer guesses k tokens, the target scores all of them in one forward pass, and a
rejection-sampling rule keeps a prefix of the guesses so that the output has exactly the target's distribution
(Leviathan et al. 2023; Chen et al. 2023). Proposers: a small draft model, or prompt lookup, which copies what
followed the most recent earlier occurrence of the context's last n-gram.

One target forward then costs about as much as one plain decode step (batch 1 reads the weights once either way)
but yields between 1 and k + 1 tokens."""
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from generate import draw, logits_to_probs


def probs_of(logits: Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None) -> Tensor:  # [N, V] -> [N, V] float32
    """The distribution a token is drawn from; greedy is a one-hot distribution, so one rule serves both."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).float()
    return logits_to_probs(logits, temperature, top_k, top_p)


def draft_step(draft, cur, input_pos, **sampling):  # cur [1, 1], input_pos [1] -> token [1], probs [1, V]
    probs = probs_of(draft(cur, input_pos)[:, -1], **sampling)
    return draw(probs), probs


def verify(model, tokens, input_pos, **sampling):  # tokens [1, k+1], input_pos [k+1] -> probs [k+1, V]
    return probs_of(model(tokens, input_pos)[0], **sampling)


def accept(p: Tensor, q: Tensor, proposed: Tensor, m: int) -> tuple[int, Tensor]:
    """Keep proposal i with probability min(1, p_i(x) / q_i(x)) until the first rejection; replace the rejected one
    by a draw from the residual max(0, p - q), normalized; if all m are kept, add a bonus draw from p.
    p [k+1, V] target, q [k, V] proposer, proposed [k] (only the first m are real) -> (kept, next token [1])."""
    i = torch.arange(m, device=p.device)
    ratio = p[i, proposed[:m]] / q[i, proposed[:m]]
    rejected = torch.rand(m, device=p.device) >= ratio  # rand < 1, so a ratio >= 1 always accepts
    n = int(torch.where(rejected.any(), rejected.int().argmax(), m)) if m else 0  # the one host sync per round
    if n == m:
        return n, draw(p[m : m + 1])
    residual = (p[n] - q[n]).clamp(min=0)
    return n, draw(residual[None] / residual.sum())


def prompt_lookup(history: list[int], ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of history's last `ngram` tokens."""
    if len(history) <= ngram:
        return []
    tail = history[-ngram:]
    for start in range(len(history) - ngram - 1, -1, -1):
        if history[start : start + ngram] == tail:
            return history[start + ngram : start + ngram + k]
    return []


@torch.no_grad()
def speculative_generate(model, prompt: list[int], max_new_tokens: int, k: int, draft=None,
                         ngram: Optional[int] = None, eos_id: Optional[int] = None,
                         callback: Optional[Callable] = None, **sampling) -> tuple[list[int], dict]:
    """Batch-1 generation with a draft model (draft=...) or prompt lookup (ngram=...) proposing k tokens a round.
    Returns the new tokens (cut before EOS) and statistics: accepted[j] counts the rounds that kept j proposals."""
    import time
    from generate import device_sync, prefill
    if k < 1:
        raise ValueError(f"--speculate_k must be at least 1, got {k}")
    if (draft is None) == (ngram is None):
        raise ValueError("speculation needs exactly one proposer: a draft model or prompt lookup")
    device, T = model.tok_embeddings.weight.device, len(prompt)
    length = T + max_new_tokens + k + 1  # a verify pass writes k + 1 cache slots past the last kept token
    for m in (model, draft) if draft is not None else (model,):
        if length > m.args.max_seq_len:
            raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) + speculate_k ({k}) + 1 "
                             f"exceeds the maximum sequence length {m.args.max_seq_len}")
        if m.max_batch_size < 1 or m.max_seq_length < length:
            m.setup_caches(1, length)
    idx = torch.tensor([prompt], device=device)
    device_sync(device)
    t0 = time.perf_counter()
    cur = prefill(model, idx, torch.arange(T, device=device), None, **sampling)  # [1]
    if draft is not None:
        draft(idx, torch.arange(T, device=device))
    out, emitted, accepted = [], [int(cur)], [0] * (k + 1)
    proposed = torch.zeros(k, dtype=torch.long, device=device)  # preallocated: compiled steps reuse their outputs
    q = torch.zeros(k, model.args.vocab_size, device=device)
    pos = T  # the cache slot of `cur`, the last emitted token, which the target has not seen yet
    while True:
        for token in emitted:
            out.append(token)
            if token == eos_id or len(out) >= max_new_tokens:
                break
        if callback is not None:
            callback(out)
        if out[-1] == eos_id or len(out) >= max_new_tokens:
            break
        if draft is not None:
            t = cur.view(1, 1)
            for i in range(k):  # no host sync: the draft's tokens stay on the device
                nxt, probs = draft_step(draft, t, torch.tensor([pos + i], device=device), **sampling)
                proposed[i], q[i] = nxt[0], probs[0]
                t = proposed[i : i + 1].view(1, 1)
            m = k
        else:
            guess = prompt_lookup(prompt + out, ngram, k)
            m = len(guess)
            proposed.fill_(out[-1])  # padding: verify always scores k + 1 positions, so it compiles once
            proposed[:m] = torch.tensor(guess, dtype=torch.long)
            q.zero_()
            q[:m].scatter_(1, proposed[:m, None], 1.0)  # a deterministic guess is a one-hot proposal
        tokens = torch.cat([cur.view(1), proposed])[None]  # [1, k+1]
        p = verify(model, tokens, torch.arange(pos, pos + k + 1, device=device), **sampling)
        n, cur = accept(p, q, proposed, m)
        if draft is not None and n == k:  # the draft never saw its own last proposal: put it in its cache
            draft_step(draft, proposed[k - 1 :].view(1, 1), torch.tensor([pos + k], device=device), **sampling)
        accepted[n] += 1
        emitted = proposed[:n].tolist() + [int(cur)]
        pos += n + 1
    device_sync(device)
    elapsed = time.perf_counter() - t0
    if eos_id is not None and eos_id in out:
        out = out[: out.index(eos_id)]
    rounds, kept = sum(accepted), sum(j * c for j, c in enumerate(accepted))
    stats = {"total_s": elapsed, "new_tokens": len(out), "target_forwards": rounds + 1,  # + prefill
             "accept_histogram": accepted,  # [j]: rounds that kept j of the k proposals
             "mean_accepted": kept / max(rounds, 1),  # proposals kept per verify pass; it also yields one more
             "acceptance_rate": kept / max(rounds * k, 1)}
    return out, stats
