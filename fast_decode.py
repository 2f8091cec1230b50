"""The Python API: load a checkpoint, its tokenizer and optionally a draft model once, then generate with keyword
arguments: plain, speculative (a draft model, prompt lookup, token trees), guided (JSON, a schema, a regex, a Lark
grammar) and chat-templated, getting the text, the tokens and the figures back.

    from fast_decode import LLM
    llm = LLM("checkpoints/stdlib-target", draft="checkpoints/stdlib-draft")
    out = llm.generate("def fibonacci(n):", max_new_tokens=40, temperature=0)  # speculate="auto"
    print(out.text, out.metrics["decode_tokens_per_sec"])

A thin layer over generate.py, speculative.py, trees.py and guided.py, which the command-line tools use too."""
import difflib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import cli
import generate as gen
import guided
import speculative
import tool_calls
from backend import Backend
from checkpoint import checkpoint_files, load_model, load_tokenizer, plan
from choose import auto as auto_chooser
from sampling import Sampling, with_defaults


@dataclass
class Completion:
    text: str  # the new text only, cut before a stop string
    tokens: list[int]  # the new tokens, without the end-of-sequence one
    metrics: dict  # the figures generate.py --metrics_json writes: ttft_ms, decode_tokens_per_sec, ...
    finish_reason: str  # "stop" (EOS, a stop string, a complete grammar), "length", "incomplete" (see below) or
    error: Optional[str] = None  # "error": this prompt could not run (a list's other prompts still do)
    logprobs: Optional[list] = None  # with logprobs=k: each new token's (log-probability, [(token, log-probability)]
    # of the k likeliest]), the model's own distribution (before temperature, penalties or truncation)
    prompt_logprobs: Optional[list] = None  # with prompt_logprobs=k: the same for each prompt token (None first)
    tool_calls: Optional[list] = None  # chat with tools: the calls made, in the OpenAI API's shape (see tool_calls.py)


DRAFTED = ("auto", "draft", "tree", "staged")  # the methods that use a draft model


class LLM:
    """A loaded checkpoint (model, tokenizer) and its draft model (draft, or None). device: "auto", "cpu", "cuda",
    "cuda:N" or "mps"; dtype: "bfloat16", "float16" or "float32"; compile: a GPU's fast path, the steps as CUDA
    graphs (the first call compiles; a CPU runs the C++ step without it); cpu_kernels: "auto" or "off";
    kv_cache_dtype: None (the model's) or "int8"; max_seq_length: the KV cache's length (default: the model's, at
    most 2048); threads: CPU threads (default: the free cores)."""

    def __init__(self, checkpoint: Union[str, Path], *, draft: Union[str, Path, None] = None,
                 device: str = "auto", dtype: str = "bfloat16", compile: bool = False, cpu_kernels: str = "auto",
                 kv_cache_dtype: Optional[str] = None, max_seq_length: Optional[int] = None,
                 threads: Optional[int] = None):
        choose("dtype", dtype, gen.DTYPES)
        choose("cpu_kernels", cpu_kernels, ("auto", "off"))
        choose("kv_cache_dtype", kv_cache_dtype, (None, "int8"))
        self.device, dt = gen.resolve_device(device), gen.DTYPES[dtype]
        config = plan(checkpoint, self.device, dt)
        length = max_seq_length or min(config.block_size, 2048)
        require(whole(length) and 1 < length <= config.block_size,
                f"max_seq_length must be in 2..{config.block_size} (the model's block_size), got {length}")
        require(threads is None or whole(threads) and threads >= 1, f"threads must be at least 1, got {threads}")
        plan(checkpoint, self.device, dt, 1, length, min(length, 2048), kv_int8=bool(kv_cache_dtype))
        self.tokenizer = load_tokenizer(checkpoint, config)
        if self.device.type == "cpu":
            cli.set_threads(threads)
        self.model = load_model(checkpoint, self.device, dt, cpu_kernels)
        self.kv_dtype, self.length = gen.KV_DTYPES.get(kv_cache_dtype or "auto"), length
        self.model.setup_caches(1, length, self.kv_dtype)
        self.draft = None if draft is None else speculative.load_draft(
            draft, checkpoint_files(checkpoint)[0], self.model, self.device, dt, cpu_kernels)
        self.backend = Backend(self.model, compile)  # how the passes run: chosen once, here
        self.draft_backend = None if self.draft is None else Backend(self.draft, compile)
        self.weight_bytes = gen.weight_bytes(self.model)
        self.choosers = {}  # (ngram, max_nodes) -> speculate="auto"'s chooser, its measurements kept between calls
        self.engine = None  # generate_many's, made at its first call (engine.Engine: its KV pool stays allocated)

    def generate(self, prompt: Union[str, list], **options) -> Union[Completion, list[Completion]]:
        """The continuation of prompt (a str: one Completion), or of each prompt of a list (many: a list of
        Completions, see generate_many). Keywords: max_new_tokens=200; temperature (0: greedy), top_k (0: no
        limit) and top_p, each by default the model's (its generation_config.json), else 0.8, 200 and 1.0; seed,
        stop (a list of strings), ignore_eos; speculate ("auto", the default: each round the guess expected to pay
        best among those below, or plain decoding when none pays, and always for a batch or with a grammar; None
        or "plain"; or one forced: "draft", "tree", "staged", "lookup", "suffix", "lookahead"), speculate_k=4,
        ngram=3, max_nodes=32, fixed_k; json, json_schema (a dict or JSON text), regex, grammar (Lark text); chat
        (the prompt as a user turn in the chat template), system; callback(text), called with the first row's new
        text after every step."""
        if not isinstance(prompt, str):
            return self.generate_many(prompt, **options)
        require(bool(prompt), "prompt must be a non-empty string or a list of prompts")
        known(options, COMPLETE | {"chat", "system"}, "generate")
        chat, system = options.pop("chat", False), options.pop("system", None)
        require(system is None or chat, "system needs chat=True")
        if chat:
            self.check_template()
        return self.complete([cli.encode_prompt(self.tokenizer, prompt, chat, system)], **options)[0]

    def generate_many(self, prompts: list, *, progress: bool = True, **options) -> list[Completion]:
        """Every prompt's continuation, all through the engine (engine.py: continuous batching over a paged KV
        cache, a shared prefix prefilled once), with a progress bar unless progress=False. A prompt is a str, or
        a dict {"prompt": str, ...} whose other keys override the call's for that prompt (its own json_schema,
        say). Keywords as generate's, less speculation and the callback: one speculates alone. A prompt that
        cannot run (too long, a bad schema) gets finish_reason "error" and its error; the others run."""
        require(isinstance(prompts, list) and prompts and all(
            isinstance(p, str) or isinstance(p, dict) and isinstance(p.get("prompt"), str) for p in prompts),
            "prompt must be a non-empty string or a non-empty list of strings or {'prompt': str, ...} dicts")
        require(options.pop("speculate", "auto") in ("auto", "plain", None) and options.pop("callback", None) is None,
                "many prompts run through the engine, which neither speculates nor calls back: give one prompt")
        known(options, PER_PROMPT, "generate_many")
        self.sampling({k: v for k, v in options.items() if k in Sampling.__dataclass_fields__})  # the call's own
        return self.run_engine([self.request(p, options) for p in prompts], progress)

    def run_engine(self, requests: list, progress: bool = False) -> list[Completion]:
        """The engine's requests run to their end (those that already failed stay as they are), as Completions."""
        from tqdm import tqdm
        if self.engine is None:
            from engine import Engine
            self.engine = Engine(self.model, self.tokenizer)
        done = []
        with tqdm(total=len(requests), disable=not progress, desc="requests") as bar:
            for r in requests:
                if r.error is None:
                    try:
                        self.engine.add(r)
                    except ValueError as e:
                        r.finish_reason, r.error = "error", str(e)
            while self.engine.has_work():
                bar.update(sum(r.finished for r in self.engine.step()))
        for r in requests:
            text = cli.new_text(self.tokenizer, r.prompt, r.out, r.sampling.stop) if r.prompt else ""
            lp, plp = r.sampling.logprobs is not None, r.sampling.prompt_logprobs is not None
            done.append(Completion(text, r.out, request_metrics(r), r.finish_reason, r.error,
                                   r.logprobs if lp else None, r.prompt_logprobs if plp else None))
        return done

    def request(self, prompt, shared: dict):
        """An engine Request for one prompt of generate_many, or one whose error says why it cannot run."""
        from engine import Request
        given = {**shared, **(prompt if isinstance(prompt, dict) else {"prompt": prompt})}
        text, chat, system = given.pop("prompt"), given.pop("chat", False), given.pop("system", None)
        options = {k: given.pop(k) for k in list(given) if k in Sampling.__dataclass_fields__}
        r = Request([], eos_ids=() if options.get("ignore_eos") else tuple(self.tokenizer.eos_ids))
        try:  # a prompt's own bad option fails it alone
            known(given, PER_PROMPT, "a prompt of generate_many")
            require(system is None or chat, "system needs chat=True")
            r.sampling = self.sampling(options)
            if chat:
                self.check_template()
            grammars = guided.grammars(**given)
            require(len(grammars) <= 1, "give at most one of json, json_schema, regex and grammar")
            r.grammar = grammars[0] if grammars else None
            r.prompt = cli.encode_prompt(self.tokenizer, text, chat, system) if text else []
        except ValueError as e:
            r.finish_reason, r.error = "error", str(e)
        return r

    def sampling(self, options: dict) -> Sampling:
        """options checked (the one check, sampling.Sampling); temperature, top_k and top_p not given (or None)
        are the model's own defaults (its generation_config.json), else 0.8, 200 and 1.0."""
        return Sampling(**{**options, **with_defaults(options, self.tokenizer.sampling_defaults)})

    def chat(self, messages: list[dict], *, tools: Optional[list] = None, tool_choice="auto",
             parallel_tool_calls: bool = True, **options) -> Completion:
        """The assistant's reply to messages ([{"role": "user", "content": "..."}, ...]) through the model's chat
        template; keywords as generate's. tools (the OpenAI API's), tool_choice ("auto", "none", "required" or
        {"type": "function", "function": {"name": ...}}): the template renders them and the reply is held to
        calls in the model's format (tool_calls.py), returned as tool_calls with finish_reason "tool_calls"."""
        require(isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(m.get("content"), str) or
                                                                        m.get("tool_calls")) for m in messages),
                "messages must be a non-empty list of {'role': str, 'content': str} dicts")
        self.check_template()
        known(options, COMPLETE - {"grammar", "json", "json_schema", "regex"} if tools else COMPLETE, "chat")
        must = None
        if tools is not None:
            require(tool_calls.supported(self.tokenizer.chat_template), "this model's chat template does not render "
                    f"tools with the {tool_calls.OPEN} format: it cannot call tools")
            funcs = tool_calls.functions(tools)
            must = tool_calls.chosen(tool_choice, [f["name"] for f in funcs])
            if must != []:
                options["grammar"] = tool_calls.grammar(funcs, must, parallel_tool_calls)
        text = self.tokenizer.apply_chat_template(tool_calls.for_template(messages), tools=tools)
        done = self.complete([self.tokenizer.encode(text, bos=False, specials=True)], **options)[0]
        if tools is not None and must != []:
            content, done.tool_calls = tool_calls.parse(done.text)
            if done.tool_calls:
                done.text, done.finish_reason = content or "", "tool_calls"
        return done

    def check_template(self):
        require(self.tokenizer.chat_template is not None, "this model has no chat template (no chat_template.jinja "
                "or tokenizer_config.json chat_template beside its tokenizer): it is not a chat model")

    def complete(self, prompts: list[list[int]], *, max_new_tokens: int = 200, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, seed: Optional[int] = None,
                 stop: Optional[list[str]] = None, ignore_eos: bool = False, speculate: Optional[str] = "auto",
                 speculate_k: int = 4, ngram: int = 3, max_nodes: int = 32, fixed_k: bool = False,
                 json: bool = False, json_schema=None, regex: Optional[str] = None, grammar: Optional[str] = None,
                 callback: Optional[Callable[[str], None]] = None, **engine_only) -> list[Completion]:
        """generate's work on token-id prompts. engine_only: min_p, the penalties, logit_bias, logprobs and
        prompt_logprobs (sampling.Sampling), which the engine applies, one prompt as many."""
        for name, value, lo in (("speculate_k", speculate_k, 1), ("ngram", ngram, 1), ("max_nodes", max_nodes, 1)):
            require(whole(value) and value >= lo, f"{name} must be a whole number of at least {lo}, got {value!r}")
        known(engine_only, ENGINE_ONLY, "generate")
        o = self.sampling(dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, stop=stop, ignore_eos=ignore_eos, **engine_only))
        temperature, top_k, top_p = o.temperature, o.top_k, o.top_p
        choose("speculate", speculate, (None, "plain") + speculative.SPECULATE)
        grammars = guided.grammars(json=json, json_schema=json_schema, regex=regex, grammar=grammar)
        require(len(grammars) <= 1, "give at most one of json, json_schema, regex and grammar")
        if any(v is not None for v in engine_only.values()):
            require(speculate in ("auto", "plain", None) and callback is None, f"{', '.join(engine_only)} run "
                    "through the engine, which neither speculates nor calls back: drop speculate and callback")
            from engine import Request
            eos = () if ignore_eos else tuple(self.tokenizer.eos_ids)
            done = self.run_engine([Request(p, o, eos, grammars[0] if grammars else None) for p in prompts])
            require(all(c.error is None for c in done), next((c.error for c in done if c.error), ""))
            return done
        if speculate == "plain" or speculate == "auto" and (grammars or len(prompts) > 1):
            speculate = None
        guide = guided.make_guide(self.tokenizer, grammars, len(prompts), self.model.args.vocab_size,
                                  speculate_k if speculate else 0)
        extra = {None: 0, "draft": speculate_k + 1, "lookup": speculate_k + 1}.get(speculate, max_nodes)
        chooser = self.choosers.setdefault((ngram, max_nodes), auto_chooser(
            self.draft_backend, ngram)) if speculate == "auto" else None
        extra = max(extra, chooser.room if chooser else getattr(self.draft, "room", 0))
        need = min(max(map(len, prompts)) + max_new_tokens + extra, self.model.args.block_size)
        if self.model.max_batch_size < len(prompts) or self.model.max_seq_length < need:
            self.model.setup_caches(len(prompts), max(need, self.length), self.kv_dtype)
        loop = speculative.make_loop(
            self.model, max_new_tokens=max_new_tokens, speculate=speculate,
            draft=self.draft if speculate in DRAFTED else None, speculate_k=speculate_k, ngram=ngram,
            adaptive=not fixed_k, max_nodes=max_nodes, guide=guide, backend=self.backend,
            draft_backend=self.draft_backend, chooser=chooser, temperature=temperature, top_k=top_k, top_p=top_p)
        eos_ids = None if ignore_eos else self.tokenizer.eos_ids
        shown = (lambda tokens: callback(cli.new_text(self.tokenizer, prompts[0], gen.cut(tokens, eos_ids, None))))
        result = loop(prompts, eos_ids, shown if callback else None, cli.stop_strings(self.tokenizer, stop), 0,
                      [seed] * len(prompts))
        metrics = result.metrics(self.weight_bytes)
        return [Completion(cli.new_text(self.tokenizer, p, r, stop), r, metrics,
                           cli.finish_reason(result, row, max_new_tokens))
                for row, (p, r) in enumerate(zip(prompts, result.rows))]


def request_metrics(r) -> dict:
    """One request's figures from the engine: its prompt, the part the prefix cache served, its time to first token
    (queueing included) and its own decoding rate."""
    t = r.times
    first, end = t.get("first"), t.get("finished")
    rate = (len(r.out) - 1) / (end - first) if first and end and end > first and len(r.out) > 1 else 0.0
    return {"prompt_tokens": len(r.prompt), "cached_tokens": r.cached_tokens, "completion_tokens": len(r.out),
            "ttft_ms": 1e3 * (first - t["arrived"]) if first and "arrived" in t else None,
            "decode_tokens_per_sec": rate, "total_s": end - t["arrived"] if end and "arrived" in t else None}


ENGINE_ONLY = {"min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
               "prompt_logprobs"}
COMPLETE = set(inspect.signature(LLM.complete).parameters) - {"self", "prompts", "engine_only"} | ENGINE_ONLY
PER_PROMPT = set(Sampling.__dataclass_fields__) | {"json", "json_schema", "regex", "grammar", "chat", "system"}


def known(options: dict, allowed: set, what: str):
    """A ValueError for the first keyword that is not one of allowed, with the closest that is."""
    for name in options:
        if name not in allowed:
            close = difflib.get_close_matches(name, sorted(allowed), n=1)
            raise ValueError(f"{what} takes no keyword {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))


def whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(ok: bool, message: str):
    if not ok:
        raise ValueError(message)


def choose(name: str, value, allowed):
    require(value in allowed, f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
