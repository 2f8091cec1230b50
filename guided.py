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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

# compact JSON with no free whitespace: a small model given room for it may write newlines until its budget ends
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class NoLlguidance(argparse.ArgumentTypeError, ValueError):
    """llguidance missing or too old: shown as it is by argparse (in an option's type, where a plain ValueError
    became "invalid regex value") and, as a ValueError, by cli.run_main."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise NoLlguidance("guided generation needs the llguidance package (pip install llguidance)") from None
    version = importlib.metadata.version("llguidance")  # 1.6 takes no list of end tokens, 1.8 misreads Lark grammars
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < (1, 9):
        raise NoLlguidance(f"guided generation needs llguidance 1.9 or newer; this is {version}")
    return llguidance


def _checked(grammar: str, what: str) -> str:
    """The grammar, or one line naming what is wrong with it (llguidance's first line)."""
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise argparse.ArgumentTypeError(f"invalid {what}: {error.strip().splitlines()[0]}")
    return grammar


def json_schema(text: str) -> str:
    """--json_schema: a file holding a JSON schema, or the schema itself as JSON text -> an llguidance grammar."""
    path = Path(text)
    try:
        is_file = not text.lstrip().startswith(("{", "[")) and path.is_file()
    except OSError:  # a long JSON text is no file name the system accepts
        is_file = False
    if not is_file and not text.lstrip().startswith("{"):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a JSON schema file nor a JSON object")
    try:
        schema = json.loads(path.read_text(encoding="utf-8") if is_file else text)
    except (ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(f"{text if is_file else 'the schema'} is not valid JSON: "
                                         f"{str(e).splitlines()[0]}") from None
    if not isinstance(schema, (dict, bool)):
        raise argparse.ArgumentTypeError("a JSON schema is an object (or true/false)")
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
        raise argparse.ArgumentTypeError(f"cannot read the grammar file {file}: {why}") from None
    return _checked(_llguidance().LLMatcher.grammar_from_lark(text), f"grammar in {file}")


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
            raise ValueError(f"{len(grammars)} grammars (--json_schema, --json, --regex, --grammar) for a batch "
                             f"of {batch_size}: give one, or one per prompt")
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
