"""Sampling: the one rule that turns a row of logits into the next token, for every loop and for the engine, and
the one check of the options that steer it.

A request's randomness is a stream of uniforms drawn up front from its seed, one per new token: token t is where
u_t falls in the running sum of the filtered distribution (a request's logit_bias and penalties on the logits, then
temperature, min_p, top_k and top_p). A token therefore
depends on its logits and its place in the answer only, never on what shares its batch or on how many tokens a pass
verifies. Speculation keeps a guess exactly when it is the token plain decoding would draw there with the same
u_t, so a seeded request writes the same tokens through every entry point, batched or speculative."""
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

NOT_FINITE = -1  # the token of a row whose logits hold a NaN or an infinity: the loops stop on it
MAX_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's top_logprobs bound)


FALLBACK = {"temperature": 0.8, "top_k": 200, "top_p": 1.0}  # where neither the request nor the model says


def with_defaults(given: dict, model: dict, fallback: dict = FALLBACK) -> dict:
    """given's temperature, top_k and top_p, each where given (not None), else the model's own default (its
    generation_config.json: tokenizer.sampling_defaults) where Sampling takes it, else fallback's."""
    def own(name: str, otherwise):
        try:
            Sampling(**{name: model.get(name, otherwise)})  # the one check of an option
        except OptionError:  # a value no request could give (a top_p of 1.5): not the model's to give either
            return otherwise
        return model.get(name, otherwise)
    return {k: given[k] if given.get(k) is not None else own(k, v) for k, v in fallback.items()}


@dataclass(frozen=True)
class Sampling:
    """How to continue a prompt, checked once here for the command lines, the Python API, the engine and the server.
    temperature 0 is greedy; top_k None (or 0) and top_p 1.0 cut nothing; seed None draws from torch's global
    generator; stop: strings that end the answer; ignore_eos: go on past the end-of-sequence tokens. min_p: drop
    the tokens less likely than min_p times the likeliest (after temperature). logit_bias: {token: bias} added to
    the logits; presence_penalty and frequency_penalty: subtracted from the logits of the tokens the answer holds,
    once and once per time (as OpenAI's); repetition_penalty: the logits of the tokens in prompt or answer divided
    by it where positive, multiplied where negative (CTRL's, as transformers'), in that order (see adjusted).
    logprobs: give each new token's log-probability and its logprobs likeliest alternatives, prompt_logprobs the
    same for every prompt token after the first, from the model's own distribution (before any of the above)."""
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: Optional[int] = 200
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Optional[tuple] = None
    ignore_eos: bool = False
    min_p: float = 0.0
    logit_bias: Optional[tuple] = None  # ((token, bias), ...) from a dict
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def __post_init__(self):
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
        check(whole(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens",
              f"max_new_tokens must be a whole number of at least 1, got {self.max_new_tokens!r}")
        check(number(self.temperature) and self.temperature >= 0, "temperature",
              f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check(self.top_k is None or whole(self.top_k) and self.top_k >= 0, "top_k",
              f"top_k must be a whole number (0: no limit), got {self.top_k!r}")
        check(number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        check(self.seed is None or whole(self.seed) and 0 <= self.seed < 2**64, "seed",
              f"seed must be a whole number in [0, 2**64), got {self.seed!r}")
        stop = self.stop
        check(stop is None or isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop), "stop",
              "stop must be a list of non-empty strings")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", f"ignore_eos must be true or false, got "
              f"{self.ignore_eos!r}")
        check(number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(number(value) and -2 <= value <= 2, name, f"{name} must be a number from -2 to 2, got {value!r}")
        check(number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              f"repetition_penalty must be a number > 0 (1: none), got {self.repetition_penalty!r}")
        bias = self.logit_bias
        bias = tuple((int(t) if isinstance(t, str) and t.strip().isdigit() else t, b) for t, b in bias.items()) \
            if isinstance(bias, dict) else bias  # (JSON's keys are strings)
        check(bias is None or isinstance(bias, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and whole(p[0]) and p[0] >= 0 and number(p[1]) and
            -100 <= p[1] <= 100 for p in bias), "logit_bias",
            "logit_bias must map token ids to biases from -100 to 100")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or whole(value) and 0 <= value <= MAX_LOGPROBS, name,
                  f"{name} must be a whole number from 0 to {MAX_LOGPROBS}, got {value!r}")
        object.__setattr__(self, "top_k", self.top_k or None)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "stop", tuple(stop) if stop else None)
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias) if bias else None)
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def adjusts(self) -> bool:  # whether its logits change before the draw (see adjusted)
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def uniforms(self, n: Optional[int] = None) -> list[float]:
        """The answer's uniforms in [0, 1), one per new token (n of them: max_new_tokens, or more for the guesses
        a speculative pass verifies past the end). A seed's first n are the same whatever n is."""
        g = None if self.seed is None else torch.Generator().manual_seed(self.seed)
        return torch.rand(n or self.max_new_tokens, generator=g, dtype=torch.float64).tolist()


class OptionError(ValueError):
    """A bad option: the message, and the option it names (a server's error says which field)."""
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check(ok: bool, param: str, message: str):
    if not ok:
        raise OptionError(param, message)


def pick(logits: Tensor, rows: list, u: list[float], allowed: Optional[Tensor] = None,
         seen: Optional[list] = None) -> list[int]:
    """Each row's next token (logits [N, V]) under its options (rows[i]: a Sampling) and its uniform u[i]: the
    argmax at temperature 0, else a draw (see draw); NOT_FINITE where the row's logits are not all finite. allowed
    [N, V] bool (a grammar's): the other tokens get -inf first, so the draw is from the model's distribution
    renormalized over the allowed ones. seen[i]: row i's (prompt, answer so far) token lists, where its options
    adjust the logits. Temperatures, probabilities and top-k candidates take one op each for all rows."""
    finite = torch.isfinite(logits.sum(-1)).tolist()  # a sum is NaN or inf if any term is; before the mask's -inf
    logits = adjusted(logits, rows, seen)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -float("inf"))
    tokens = [t if ok else NOT_FINITE for t, ok in zip(logits.argmax(-1).tolist(), finite)]
    hot = [i for i, r in enumerate(rows) if r.temperature > 0 and finite[i]]
    if not hot:
        return tokens
    x = logits[hot].float() / torch.tensor([rows[i].temperature for i in hot], device=logits.device)[:, None]
    for n in [n for n, i in enumerate(hot) if rows[i].min_p]:  # p < min_p * p_max, as logits
        x[n] = x[n].masked_fill(x[n] < x[n].max() + math.log(rows[hot[n]].min_p), -float("inf"))
    cut = [n for n, i in enumerate(hot) if rows[i].top_k]
    top = x[cut].topk(min(max(rows[hot[n]].top_k for n in cut), x.size(-1))) if cut else None  # [n, K], best first
    p = x.softmax(-1) if len(cut) < len(hot) else None  # [N, V]
    for n, i in enumerate(hot):
        r = rows[i]
        if r.top_k:
            j = cut.index(n)
            v, t = top.values[j, : r.top_k].softmax(0), top.indices[j, : r.top_k]
            tokens[i] = int(t[draw(v, r.top_p, u[i])])
        elif r.top_p < 1.0:
            v, t = ranked(p[n], r.top_p)
            tokens[i] = int(t[draw(v, r.top_p, u[i])])
        else:
            tokens[i] = draw(p[n], 1.0, u[i])
    return tokens


def adjusted(logits: Tensor, rows: list, seen: Optional[list]) -> Tensor:  # logits [N, V] -> [N, V]
    """The logits with each row's logit_bias added, then its penalties applied: repetition_penalty to the tokens of
    prompt and answer, presence_penalty and frequency_penalty to those of the answer (seen[i]: row i's (prompt,
    answer) token lists). Rows that adjust nothing are as they were, and without any such row logits is returned."""
    at = [i for i, r in enumerate(rows) if r.adjusts]
    if not at:
        return logits
    logits, device = logits.float().clone(), logits.device
    for i in at:
        r, x, (prompt, out) = rows[i], logits[i], seen[i]
        if r.logit_bias:
            ids, bias = zip(*r.logit_bias)
            x[list(ids)] += torch.tensor(bias, device=device)
        if r.repetition_penalty != 1:
            ids = torch.tensor(sorted(set(prompt) | set(out)), device=device)
            v = x[ids]
            x[ids] = torch.where(v > 0, v / r.repetition_penalty, v * r.repetition_penalty)
        if out and (r.presence_penalty or r.frequency_penalty):
            ids, counts = torch.tensor(out, device=device).unique(return_counts=True)
            x[ids] -= r.frequency_penalty * counts.float() + r.presence_penalty
    return logits


def logprobs(logits: Tensor, tokens: list[int], k: int) -> list[tuple]:
    """Each row's (log-probability of tokens[i], its k likeliest tokens as [(token, log-probability)], best first)
    under logits [N, V]: the model's own distribution, before any option shapes it."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor([max(t, 0) for t in tokens], device=lp.device)[:, None])[:, 0].tolist()
    top = lp.topk(k) if k else None
    return [(c, list(zip(top.indices[i].tolist(), top.values[i].tolist())) if k else []) for i, c in enumerate(chosen)]


def ranked(p: Tensor, top_p: float) -> tuple[Tensor, Tensor]:  # p [V] -> probabilities and tokens, best first
    """The most likely tokens, enough of them to hold top_p of p, best first, without sorting the whole
    vocabulary: a sort of 49,152 takes 5 ms on a CPU core, a top-64 a twentieth of that, and a nucleus is most often
    a few dozen tokens."""
    k = 64
    while True:
        v, t = p.topk(min(k, p.numel()))
        if k >= p.numel() or float(v.sum()) >= top_p:
            return v, t
        k *= 8


def draw(p: Tensor, top_p: float, u: float) -> int:  # p [K] >= 0, not all 0 (ranked best first when top_p < 1)
    """The index where u lands in p's running sum, over the nucleus: the tokens the tokens ranked above which hold
    less than top_p (the first is always in). u in [0, 1); 1 - u in (0, 1], so a token of probability 0 is never
    the first whose running sum reaches it."""
    if top_p < 1.0:
        p = p.masked_fill(p.cumsum(0) - p >= top_p, 0.0)
    c = p.cumsum(0)
    return min(int(torch.searchsorted(c, (1 - u) * c[-1:])), p.numel() - 1)
