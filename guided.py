"""Guided generation: output that always matches a JSON schema, a regex or a Lark grammar.

llguidance compiles the grammar into a matcher that, after the tokens so far, fills a bitmask of the tokens that
keep the text inside the grammar: one bit per token, [B, ceil(V / 32)] int32. The decode loop (generate.py)
applies it to the logits on the device, inside the sampling step: a masked token gets -inf, so greedy decoding
picks the best allowed token and sampling draws from the model's distribution renormalized over the allowed
ones. The mask for the next token is computed on a CPU thread while the device runs the forward pass (llguidance
releases the GIL). Where the grammar leaves one way to go on (`{"name": "` after `{`), the forced tokens are fed
in one forward pass, like a short prefill, instead of one step each (fast-forward)."""
import argparse
import importlib.metadata
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from model import kv_bucket

# compact JSON with no free whitespace: a small model given room for it may write newlines until its budget ends
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(argparse.ArgumentTypeError, ValueError):
    """A grammar that cannot be used, or llguidance missing: a ValueError to the library's callers, and shown as it
    is by argparse in an option's type (where a plain ValueError becomes "invalid regex value")."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("guided generation needs the llguidance package (pip install llguidance)") from None
    version = importlib.metadata.version("llguidance")  # 1.6 takes no list of end tokens, 1.8 misreads Lark grammars
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < (1, 9):
        raise GrammarError(f"guided generation needs llguidance 1.9 or newer; this is {version}")
    return llguidance


def _checked(grammar: str, what: str) -> str:
    """The grammar, or one line naming what is wrong with it (llguidance's first line)."""
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {what}: {error.strip().splitlines()[0]}")
    return grammar


def json_schema(text: str) -> str:
    """--json_schema: a file holding a JSON schema, or the schema itself as JSON text -> an llguidance grammar."""
    path = Path(text)
    try:
        is_file = not text.lstrip().startswith(("{", "[")) and path.is_file()
    except OSError:  # a long JSON text is no file name the system accepts
        is_file = False
    if not is_file and not text.lstrip().startswith("{"):
        raise GrammarError(f"{text!r} is neither a JSON schema file nor a JSON object")
    try:
        schema = json.loads(path.read_text(encoding="utf-8") if is_file else text)
    except (ValueError, OSError) as e:
        raise GrammarError(f"{text if is_file else 'the schema'} is not valid JSON: "
                                         f"{str(e).splitlines()[0]}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema is an object (or true/false)")
    return _checked(_llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), "JSON schema")


def any_json() -> str:
    """--json: a JSON document, an object or an array with any content. Not a bare value: a model that starts a
    number at the top level may never end it."""
    return _llguidance().LLMatcher.grammar_from_json_schema({"type": ["object", "array"]}, defaults=JSON_OPTIONS)


def regex(pattern: str) -> str:  # --regex: the whole output matches the pattern
    return _checked(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")


def lark(file: str) -> str:  # --grammar: a Lark grammar file (llguidance's dialect: start rule, /regex/ terminals)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8"
        raise GrammarError(f"cannot read the grammar file {file}: {why}") from None
    return lark_text(text, f"grammar in {file}")


def lark_text(text: str, what: str = "Lark grammar") -> str:  # a Lark grammar, as text
    return _checked(_llguidance().LLMatcher.grammar_from_lark(text), what)


# ---- the tokenizer, as llguidance sees it --------------------------------------------------------------------------

class _TokenBytes:
    """What llguidance needs of a tokenizer without a tokenizer.json: each token's bytes and an encoder."""

    def __init__(self, tokenizer, vocab_size: int):
        sp = tokenizer._sp
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.tokens, self.special_token_ids = [], []
        for i in range(vocab_size):
            if i >= sp.vocab_size() or sp.is_control(i) or sp.is_unknown(i):
                self.tokens.append(b"")
                self.special_token_ids.append(i)
            elif sp.is_byte(i):  # <0xAB>
                self.tokens.append(bytes([int(sp.id_to_piece(i)[3:5], 16)]))
            else:
                self.tokens.append(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        self._sp = sp

    def __call__(self, text: str) -> list[int]:
        return self._sp.encode(text)


def llg_tokenizer(tokenizer, vocab_size: int):
    """An llguidance tokenizer over the model's vocabulary (ids past the tokenizer's, padding, are never allowed);
    every EOS id ends the output once the grammar is satisfied."""
    llg = _llguidance()
    eos = list(tokenizer.eos_ids) or None
    if tokenizer._hf is not None:
        return llg.LLTokenizer(tokenizer._hf.to_str(), n_vocab=vocab_size, eos_token=eos)
    if tokenizer._tt is not None:
        tt = tokenizer._tt
        return llg.LLTokenizer.from_tiktoken(encoder=tt._mergeable_ranks, special_tokens=tt._special_tokens,
                                             pattern=tt._pat_str, eos_token=eos, n_vocab=vocab_size)
    return llg.LLTokenizer(llg.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size)), n_vocab=vocab_size,
                           eos_token=eos)


# ---- the matchers --------------------------------------------------------------------------------------------------

class Guide:
    """One llguidance matcher per batch row, each with its own grammar, and the host bitmask they fill
    ([B, W] int32, pinned on a CUDA machine so that its upload does not wait)."""

    def __init__(self, tokenizer, grammars: list[str], batch_size: int, vocab_size: int, k: int = 0,
                 fast_forward: bool = True):
        if len(grammars) not in (1, batch_size):
            raise ValueError(f"{len(grammars)} grammars for a batch of {batch_size}: give one, or one per prompt")
        llg = _llguidance()
        self.tokenizer = llg_tokenizer(tokenizer, vocab_size)
        grammars = grammars * (batch_size // len(grammars))
        self.matchers = [llg.LLMatcher(self.tokenizer, g, log_level=0) for g in grammars]
        for m in self.matchers:
            if m.is_error():  # what validation without the tokenizer could not see
                raise ValueError(f"the grammar cannot be used with this tokenizer: {m.get_error().splitlines()[0]}")
        self.words = (vocab_size + 31) // 32
        pin = torch.cuda.is_available()
        self.bits = torch.full((max(batch_size, k + 1), self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.pool = ThreadPoolExecutor(1)  # the mask is computed here while the forward pass runs
        self.forced = 0  # tokens fed by fast-forward, this generation
        self.forcing = fast_forward  # off: forced tokens come one step each, as the mask's only allowed token

    def reset(self):
        for m in self.matchers:
            m.reset()
        self.forced = 0

    def fill(self, done: Optional[list[bool]] = None) -> Tensor:  # -> [B, W], this object's buffer
        """Each row's allowed tokens now; a finished row allows every token (its output is discarded)."""
        for b, m in enumerate(self.matchers):
            if done is not None and done[b]:
                self.bits[b] = -1
            else:
                m.unsafe_compute_mask_ptr(self.bits[b].data_ptr(), 4 * self.words)
        return self.bits[: len(self.matchers)]

    def fill_async(self, done: Optional[list[bool]] = None) -> Future:
        return self.pool.submit(self.fill, done)

    def consume(self, row: int, token: int):
        if not self.matchers[row].consume_token(token):  # the mask forbade it: a bug, never the model's doing
            raise RuntimeError(f"the grammar rejected token {token}: {self.matchers[row].get_error()}")

    def complete(self, row: int) -> bool:
        """The grammar is satisfied and nothing can follow: stop without waiting for EOS. A matcher that failed
        (llguidance's limits on grammar work per token, say) is stopped too: that is an error, not an output."""
        m = self.matchers[row]
        if m.is_error():
            raise ValueError(f"the grammar matcher failed: {m.get_error().strip().splitlines()[0]}")
        return m.is_stopped()

    def incomplete(self, row: int) -> bool:  # a row cut by max_new_tokens before its grammar was satisfied
        return not self.matchers[row].is_accepting()

    def fast_forward(self, row: int, limit: int) -> list[int]:
        """The tokens the grammar forces next (at most limit), consumed."""
        tokens = self.matchers[row].compute_ff_tokens()[:limit] if self.forcing else []
        for t in tokens:
            self.consume(row, t)
        self.forced += len(tokens)
        return tokens

    # speculation (batch 1): proposals are consumed one by one, a mask kept after each, then rolled back

    def mask_row(self, i: int) -> Tensor:  # -> [1, W]: row 0's mask now, into the buffer's row i
        self.matchers[0].unsafe_compute_mask_ptr(self.bits[i].data_ptr(), 4 * self.words)
        return self.bits[i : i + 1]

    def rollback(self, n: int) -> Tensor:  # -> [n + 1, W]: the masks before each of n proposals and after them
        self.mask_row(n)
        self.matchers[0].rollback(n)
        return self.bits[: n + 1]

    def along(self, tokens: list[int]) -> tuple[int, Tensor]:
        """How many of the proposed tokens the grammar allows in a row, and the masks along them ([n + 1, W])."""
        n = 0
        for t in tokens:
            if not allows(self.mask_row(n)[0], t) or self.complete(0):
                break
            self.consume(0, t)
            n += 1
        return n, self.rollback(n)


def allows(bits: Tensor, token: int) -> bool:  # bits [W] on the host
    return bool((int(bits[token // 32]) >> (token % 32)) & 1)


def allowed_tokens(bits: Tensor, vocab_size: int) -> Tensor:  # bits [..., W] int32 -> [..., V] bool, on the device
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :vocab_size]


# ---- the loop ------------------------------------------------------------------------------------------------------

def generate_guided(backend, idx, left_pad, cached: int, max_new_tokens: int, eos_ids, guide: Guide, sync, answers,
                    pick) -> tuple[list[list[int]], float, float, int, list[int]]:
    """generate.generate's loop under grammars (idx [B, T], left-padded): each row's tokens, the prefill and decode
    seconds, the forward passes after prefill, and the rows cut by max_new_tokens before their grammar was
    complete. Each step the host needs the sampled tokens to advance the matchers: that is the step's one sync.
    The next mask is computed on a CPU thread while the forward pass runs, and is applied on the device by
    pick(logits [B, V], bits [B, W], i) -> [B], the rows' token i. At batch 1 the tokens the grammar forces are fed
    in one forward pass with the sampled one (fast-forward). answers: each row's generate.Answer (its end-of-sequence
    ids, stop strings and callback); a row also ends once its grammar is complete. sync(device) waits for the
    device."""
    model, device, (B, T) = backend.model, idx.device, idx.shape
    eos, fill = set(eos_ids or ()), (list(eos_ids or ()) or [0])[0]
    slots = torch.arange(T + max_new_tokens, device=device)  # positions are slices of this: no allocation
    bits = torch.empty(B, guide.words, dtype=torch.int32, device=device)

    def upload(mask) -> Tensor:  # the host bitmask, on the device (non_blocking: it is pinned)
        return mask.result() if device.type == "cpu" else bits.copy_(mask.result(), non_blocking=True)

    guide.reset()
    forwards = 0
    sync(device)
    t0 = time.perf_counter()
    mask = guide.fill_async()
    logits = backend.prefill(idx[:, cached:], slots[cached:T], left_pad, kv_bucket(T, model.max_seq_length))
    tokens = pick(logits, upload(mask), 0).tolist()
    t1 = time.perf_counter()
    pos = T
    while True:
        for b, (t, a) in enumerate(zip(tokens, answers)):
            if not a.done:
                a.add([t], lambda t, b=b: t not in eos and (guide.consume(b, t) or guide.complete(b)))
        feed = [[fill if a.done else t] for t, a in zip(tokens, answers)]
        if B == 1 and not answers[0].done:  # forced tokens go in with the sampled one; batch rows need own positions
            forced = guide.fast_forward(0, max_new_tokens - len(answers[0].out))
            answers[0].out += forced
            feed[0] += forced
            answers[0].done = guide.complete(0) or len(answers[0].out) >= max_new_tokens
        if all([a.round() for a in answers]):  # (every row's callback and stop strings)
            break
        S = len(feed[0])
        mask = guide.fill_async([a.done for a in answers])  # on the CPU thread, while the forward pass runs
        logits = backend.decode(torch.tensor(feed, device=device), slots[pos : pos + S], left_pad,
                                kv_bucket(pos + S, model.max_seq_length))
        tokens = pick(logits, upload(mask), len(answers[0].out) if B == 1 else forwards + 1).tolist()
        pos, forwards = pos + S, forwards + 1
    sync(device)
    rows = [a.out for a in answers]
    incomplete = [b for b, r in enumerate(rows) if len(r) >= max_new_tokens and not eos & set(r) and
                  guide.incomplete(b)]
    return rows, t1 - t0, time.perf_counter() - t1, forwards, incomplete


def grammars(**given) -> list[str]:
    """The llguidance grammars for the keywords given, each a way to constrain the output: json (True: any JSON
    document), json_schema (a dict, or JSON text), regex (a pattern), grammar (a Lark grammar's text)."""
    schema = given.get("json_schema")
    schema = json.dumps(schema) if schema is not None and not isinstance(schema, str) else schema
    made = ([any_json()] if given.get("json") else []) + ([json_schema(schema)] if schema is not None else [])
    made += [regex(given["regex"])] if given.get("regex") is not None else []
    return made + ([lark_text(given["grammar"])] if given.get("grammar") is not None else [])


def make_guide(tokenizer, grammars: list[str], batch_size: int, vocab_size: int, k: int = 0) -> Optional[Guide]:
    """The matchers for the grammars (one for every row, or one per row), or None without any."""
    return Guide(tokenizer, grammars, batch_size, vocab_size, k) if grammars else None
