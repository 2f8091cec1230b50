"""One Tokenizer over SentencePiece (Llama-2, Mistral) and tiktoken BPE rank files (Llama-3).
The backend is chosen by sniffing the file content, never its name."""
import base64
import binascii
import re
from pathlib import Path

import sentencepiece as spm

LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_NUM_SPECIAL = 256
_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+\r?")
MAX_BYTES = 1 << 30  # the largest real tokenizer files are tens of MB; anything near this is not one


def _llama3_specials():
    named = ["<|begin_of_text|>", "<|end_of_text|>"]
    named += [f"<|reserved_special_token_{i}|>" for i in range(4)]
    named += ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    rest = LLAMA3_NUM_SPECIAL - len(named)
    return named + [f"<|reserved_special_token_{i}|>" for i in range(5, 5 + rest)]


def _parse_ranks(data, path):
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}: malformed tiktoken rank file at line {n}") from None
        if token in ranks:
            raise ValueError(f"{path}: line {n} repeats a token of an earlier line")
        ranks[token] = rank
    if len(set(ranks.values())) != len(ranks):  # tiktoken's core aborts the process on this, so check first
        raise ValueError(f"{path}: two tokens share one rank")
    return ranks


class Tokenizer:
    def __init__(self, path):
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: tokenizer file not found")
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"{path} is {path.stat().st_size / 1e9:.1f} GB, too large to be a tokenizer")
        data = path.read_bytes()
        if not data.strip():
            raise ValueError(f"{path}: tokenizer file is empty")
        if _RANK_LINE.fullmatch(data.split(b"\n", 1)[0]):
            self._init_tiktoken(_parse_ranks(data, path), path)
        else:
            self._init_sentencepiece(data, path)

    def _init_tiktoken(self, ranks, path):
        try:
            import tiktoken  # optional: only Llama-3 style tokenizers need it
        except ImportError:
            raise ValueError(f"{path}: a tiktoken tokenizer needs the tiktoken package (pip install tiktoken)") from None
        specials = {s: len(ranks) + i for i, s in enumerate(_llama3_specials())}
        try:
            self._tt = tiktoken.Encoding(path.name, pat_str=LLAMA3_PATTERN,
                                         mergeable_ranks=ranks, special_tokens=specials)
        except BaseException as e:  # tiktoken's Rust panics derive from BaseException, not Exception
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ValueError(f"{path}: invalid tiktoken rank file ({type(e).__name__})") from None
        self._sp = None
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]
        self.vocab_size = self._tt.n_vocab

    def _init_sentencepiece(self, data, path):
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=data)
        except Exception as e:  # protobuf parse errors surface as RuntimeError with multi-line text
            raise ValueError(f"{path}: neither a SentencePiece model nor a tiktoken rank file") from e
        self._tt = None
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        self.vocab_size = self._sp.vocab_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        if self._sp is not None:
            ids = self._sp.encode(text)
        else:
            # Prompts are plain text: "<|eot_id|>" typed by a user must not become the special id.
            ids = self._tt.encode(text, allowed_special=set(), disallowed_special=())
        return [self.bos_id] + ids if bos else ids

    def decode(self, ids: list[int]) -> str:
        # a model's vocabulary may be padded past the tokenizer's (to a multiple of 64, say): those ids have no text
        ids = [int(i) for i in ids if 0 <= i < self.vocab_size]
        if self._sp is not None:
            return self._sp.decode(ids)
        # errors="replace": a streaming prefix may end mid UTF-8 sequence.
        return self._tt.decode(ids, errors="replace")


def load_tokenizer(path) -> Tokenizer:
    return Tokenizer(path)
