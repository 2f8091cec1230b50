"""One Tokenizer over SentencePiece (Llama-2, Mistral), tiktoken BPE rank files (Llama-3) and Hugging Face
tokenizer.json files (SmolLM2, Qwen2.5, Llama-3.x, Mistral v0.3). The backend is chosen by sniffing the file
content, never its name. Beside the file, tokenizer_config.json, generation_config.json and chat_template.jinja
give the special tokens, every end-of-sequence id and the chat template, read as transformers reads them."""
import base64
import binascii
import json
import re
from datetime import datetime
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
        self._sp = self._tt = self._hf = None
        if data.lstrip()[:1] == b"{":
            self._init_hf(data, path)
        elif _RANK_LINE.fullmatch(data.split(b"\n", 1)[0]):
            self._init_tiktoken(_parse_ranks(data, path), path)
        else:
            self._init_sentencepiece(data, path)
        self._read_companions(path.parent)

    def _init_tiktoken(self, ranks, path):
        try:
            import tiktoken  # optional: only Llama-3 style tokenizers need it
        except ImportError:
            raise ValueError(f"{path}: a tiktoken tokenizer needs the tiktoken package (pip install tiktoken)") from None
        self._specials = specials = {s: len(ranks) + i for i, s in enumerate(_llama3_specials())}
        try:
            self._tt = tiktoken.Encoding(path.name, pat_str=LLAMA3_PATTERN,
                                         mergeable_ranks=ranks, special_tokens=specials)
        except BaseException as e:  # tiktoken's Rust panics derive from BaseException, not Exception
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ValueError(f"{path}: invalid tiktoken rank file ({type(e).__name__})") from None
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]
        self.vocab_size = self._tt.n_vocab

    def _init_sentencepiece(self, data, path):
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=data)
        except Exception as e:  # protobuf parse errors surface as RuntimeError with multi-line text
            raise ValueError(f"{path}: neither a SentencePiece model, a tiktoken rank file nor a tokenizer.json") from e
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        self.vocab_size = self._sp.vocab_size()

    def _init_hf(self, data, path):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self._hf = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # malformed JSON or an unknown model type: tokenizers raises with long texts
            raise ValueError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0][:120]})") from None
        self.bos_id = self.eos_id = None  # from tokenizer_config.json; the post-processor adds BOS, if any
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)

    def _read_companions(self, folder: Path):
        """Special tokens, end-of-sequence ids and the chat template, from the files transformers reads."""
        config, generation = _read_json(folder / "tokenizer_config.json"), _read_json(folder / "generation_config.json")
        self.sampling_defaults = sampling_defaults(folder)
        self.special_tokens = {k: _content(v) for k, v in config.items() if k.endswith("_token") and _content(v)}
        for key in ("bos", "eos"):
            named = self.special_tokens.get(f"{key}_token")
            if named is not None and self.token_id(named) is not None:
                setattr(self, f"{key}_id", self.token_id(named))
        for key in ("bos", "eos"):  # templates write {{ bos_token }}; SentencePiece files name theirs inside
            if getattr(self, f"{key}_id") is not None and getattr(self, f"{key}_id") >= 0:
                self.special_tokens.setdefault(f"{key}_token", self._piece(getattr(self, f"{key}_id")))
        listed = generation.get("eos_token_id")  # instruct models may end a turn with several ids
        listed = listed if isinstance(listed, list) else [listed] if isinstance(listed, int) else []
        self.eos_ids = list(dict.fromkeys([i for i in [self.eos_id, *listed] if isinstance(i, int)]))
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        self.chat_template = template if isinstance(template, str) else None

    def _piece(self, i: int) -> str:
        if self._hf is not None:
            return self._hf.id_to_token(i)
        if self._tt is not None:
            return next((t for t, j in self._specials.items() if j == i), None) or self.decode([i])
        return self._sp.id_to_piece(i)

    def token_id(self, text: str):
        """The id of one whole token given as text (a special token's name), or None."""
        if self._hf is not None:
            return self._hf.token_to_id(text)
        if self._tt is not None:
            return self._specials.get(text)
        i = self._sp.piece_to_id(text)
        return i if self._sp.id_to_piece(i) == text else None

    def encode(self, text: str, bos: bool = True, specials: bool = False) -> list[int]:
        """specials: let special-token names in the text become their ids, as a chat template's output needs;
        typed by a user in a plain prompt, "<|eot_id|>" stays text."""
        if self._hf is not None:
            self._hf.encode_special_tokens = not specials
            return self._hf.encode(text, add_special_tokens=bos).ids  # the post-processor adds BOS if the model has one
        if self._sp is not None:
            ids = self._sp.encode(text) if not specials else self._encode_with_specials(text)
        else:
            ids = self._tt.encode(text, allowed_special="all" if specials else set(), disallowed_special=())
        return [self.bos_id] + ids if bos else ids

    def _encode_with_specials(self, text: str) -> list[int]:  # SentencePiece has no added tokens: split on names
        names = [t for t in self.special_tokens.values() if self.token_id(t) is not None]
        if not names:
            return self._sp.encode(text)
        parts = re.split("(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + ")", text)
        return [i for n, part in enumerate(parts) if part
                for i in ([self.token_id(part)] if n % 2 else self._sp.encode(part))]

    def decode(self, ids: list[int], specials: bool = True) -> str:
        """specials=False: the text a reader sees, without special tokens (a chat template's markers, EOS)."""
        # a model's vocabulary may be padded past the tokenizer's (to a multiple of 64, say): those ids have no text
        ids = [int(i) for i in ids if 0 <= i < self.vocab_size]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=not specials)
        if self._sp is not None:
            return self._sp.decode(ids)  # (it writes no control token, BOS and EOS among them, either way)
        if not specials:
            ids = [i for i in ids if i < self.vocab_size - len(self._specials)]
        # errors="replace": a streaming prefix may end mid UTF-8 sequence.
        return self._tt.decode(ids, errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """The conversation as the model was trained to see it, rendered as transformers renders it: jinja2,
        sandboxed, with the same options and helpers."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (no chat_template.jinja or tokenizer_config.json "
                             "chat_template beside its tokenizer); it is not a chat model")
        return render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens, tools)


def sampling_defaults(folder: Path) -> dict:
    """The sampling options a checkpoint's generation_config.json names (temperature, top_k, top_p), as vLLM reads
    them; sampling.with_defaults checks each and uses it where the user gives none."""
    generation = _read_json(Path(folder) / "generation_config.json")
    return {k: generation[k] for k in ("temperature", "top_k", "top_p") if k in generation}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {str(e).splitlines()[0]}") from None
    except RecursionError:  # Python's parser recurses once per level
        raise ValueError(f"{path} is not valid JSON: it is nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def _content(value):  # tokenizer_config.json writes a special token as "<s>" or as {"content": "<s>", ...}
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict,
                tools=None) -> str:
    from jinja2 import TemplateError, ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # a template from a download runs no Python

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None, separators=None, sort_keys=False):  # as transformers: non-ASCII kept as is
        return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **special_tokens, **({"tools": tools} if tools else {}))
    except TemplateError as e:
        raise ValueError(f"the chat template failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None


def load_tokenizer(path) -> Tokenizer:
    return Tokenizer(path)
