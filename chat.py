"""Chat with a model in the terminal, with its chat template. The KV cache is kept from turn to turn: each turn
prefills only the tokens the cache does not already hold (the new user message, and whatever the template
writes around it), so a long conversation does not get slower to answer. Commands: /reset, /system TEXT,
/save FILE, /load FILE, /stats, /help, /quit. Ctrl-C stops the reply being written; at the prompt, a second one
leaves. When standard input is not a terminal, each line is one user turn and each reply is printed on its own."""
import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line and status 130, as cli.run_main says later
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted", file=sys.stderr), os._exit(130)))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402


import checkpoint  # noqa: E402
import cli  # noqa: E402
import generate  # noqa: E402
from backend import Backend  # noqa: E402
import guided  # noqa: E402
import speculative  # noqa: E402

CHAT_MODEL = cli.DEFAULT_CHECKPOINT.parent / "SmolLM2-135M-Instruct"  # the quick start's (the built-in is no chat model)
HISTORY = Path.home() / ".cache" / "fast-decode" / "chat_history"
HELP = ("/reset  forget the conversation        /system TEXT  set the system message (and reset)\n"
        "/save FILE  write the conversation as JSON   /load FILE  read one back\n"
        "/stats  context use and the last turn's speed   /quit  leave (or Ctrl-D)\n"
        "Ctrl-C  stop the reply being written (twice at the prompt: leave)")


@dataclass
class Conversation:
    system: Optional[str] = None
    turns: list[dict] = field(default_factory=list)  # user and assistant messages, alternating
    cached: list[int] = field(default_factory=list)  # the tokens whose K/V the cache holds: token i in slot i

    def messages(self, user: Optional[str] = None) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns + ([{"role": "user", "content": user}] if user is not None else [])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fit_context(chat: Conversation, tokenizer, user: str, room: int) -> tuple[list[int], int]:
    """The prompt for this turn, and how many of the oldest exchanges were dropped so that the prompt and the
    reply fit in `room` tokens. The kept text is prefilled again from where it first differs from the cache."""
    dropped = 0
    while True:
        ids = tokenizer.encode(tokenizer.apply_chat_template(chat.messages(user)), bos=False, specials=True)
        if len(ids) <= room or len(chat.turns) < 2:
            return ids, dropped
        del chat.turns[:2]
        dropped += 1


def answer(chat: Conversation, user: str, tokenizer, model, loop: Callable, *, max_new_tokens: int, extra: int = 0,
           stop: Optional[list[str]] = None, ignore_eos: bool = False, stream: bool = False) -> dict:
    """One turn: prompt, reply (streamed to standard output if stream), figures. extra: the cache slots a
    speculative round writes past the reply."""
    room = model.max_seq_length - max_new_tokens - extra
    ids, dropped = fit_context(chat, tokenizer, user, room)
    if dropped:
        print(f"(the context of {model.max_seq_length} tokens is full: dropped the oldest {dropped} exchange"
              f"{'s' if dropped > 1 else ''}; /reset starts afresh)", file=sys.stderr)
    if len(ids) > room:
        raise ValueError(f"this message makes a prompt of {len(ids)} tokens, and with {max_new_tokens} new tokens "
                         f"that exceeds the context of {model.max_seq_length}; /reset, or write less")
    cached = min(common_prefix(chat.cached, ids), len(ids) - 1)  # prefill needs at least one token to predict from
    eos_ids = None if ignore_eos else tokenizer.eos_ids
    streamer = cli.make_streamer(tokenizer, ids, eos_ids) if stream else None
    try:
        result = loop([ids], eos_ids, streamer, cli.stop_strings(tokenizer, stop), cached)
    except KeyboardInterrupt:  # Ctrl-C: the reply stops and is not kept; the cache past the shared part is stale
        chat.cached = ids[:cached]
        raise
    reply = result.rows[0]
    text = cli.new_text(tokenizer, ids, reply, stop)
    chat.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
    chat.cached = ids + reply[:-1]  # fed back through the model: all but the last new token
    m = result.metrics(0)
    return {"prefill_tokens": result.prompt_tokens, "new_tokens": len(reply), "ttft_ms": m["ttft_ms"],
            "decode_tokens_per_sec": m["decode_tokens_per_sec"], "context_tokens": len(ids) + len(reply),
            "incomplete": m["incomplete"], "methods": m["methods"], "text": text}


def command(line: str, chat: Conversation, stats: list[dict], model) -> bool:
    """Run a /command; False on /quit."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        chat.turns, chat.cached = [], []
        print("(conversation cleared)")
    elif name == "/system":
        chat.system, chat.turns = rest or None, []
        print("(system message set; conversation cleared)" if rest else "(system message removed)")
    elif name == "/save":
        if not rest:
            raise ValueError("/save needs a file name")
        cli.check_output_file(Path(rest), "/save", '"messages"')
        text = json.dumps({"system": chat.system, "messages": chat.turns}, indent=2, ensure_ascii=False)
        cli.write_file(Path(rest), lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
        print(f"(saved {len(chat.turns)} messages to {rest})")
    elif name == "/load":
        chat.system, chat.turns = read_conversation(Path(rest))
        print(f"(loaded {len(chat.turns)} messages; the next turn prefills them)")
    elif name == "/stats":
        last = stats[-1] if stats else None
        print(f"(context: {last['context_tokens'] if last and chat.turns else 0} of {model.max_seq_length} tokens"
              + (f"; last turn: prefill {last['prefill_tokens']} tokens, time to first token "
                 f"{last['ttft_ms']:.0f} ms, {last['new_tokens']} new tokens at "
                 f"{last['decode_tokens_per_sec']:.1f} tokens/sec)" if last else ")"))
    else:
        print(HELP)
    return True


def read_conversation(path: Path) -> tuple[Optional[str], list[dict]]:
    data = json.loads(cli.check_text_file(path, "/load").read_text(encoding="utf-8") or "null")
    turns = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(turns, list) or not all(isinstance(t, dict) and t.get("role") in ("user", "assistant")
                                              and isinstance(t.get("content"), str) for t in turns):
        raise ValueError(f"{path} is not a conversation saved by /save")
    system = data.get("system")
    return system if isinstance(system, str) else None, turns


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--checkpoint_path", type=Path, default=CHAT_MODEL, help="a checkpoint whose tokenizer has a "
                   "chat template (tokenizer_config.json or chat_template.jinja) (default: README's conversion of "
                   "SmolLM2-135M-Instruct, checkpoints/SmolLM2-135M-Instruct)")
    p.add_argument("--system", metavar="TEXT", help="the system message")
    cli.add_sampling_options(p, max_new_tokens=512, temperature=0.7)
    p.add_argument("--max_seq_length", type=cli.positive_int, help="the context, in tokens, kept in the KV cache "
                   "(default: the model's, at most 4096)")
    cli.add_kv_cache_option(p)
    cli.add_device_options(p)
    p.add_argument("--compile", action="store_true", help="compile what model.py runs: CUDA graphs on a GPU "
                   "(on a CPU the C++ step already runs every reply)")
    p.add_argument("--compile_prefill", action="store_true", help="compile prefill with dynamic shapes")
    p.add_argument("--speculate", default="auto", choices=["auto", "plain", "lookup", "suffix", "lookahead"],
                   help="auto (the default): each round the guess expected to pay best, or plain decoding "
                   "when none does (and always with a grammar); or one method forced")
    p.add_argument("--prompt_lookup", type=cli.positive_int, metavar="N", help="speculate by looking the last N "
                   "tokens up in the conversation (good when replies quote it)")
    p.add_argument("--speculate_k", type=cli.positive_int, default=8, help="with --prompt_lookup: tokens per guess")
    p.add_argument("--suffix", action="store_true", help="speculate with the most frequent continuations of the "
                   "conversation's earlier text, from a suffix trie kept across turns")
    p.add_argument("--metrics_json", type=Path, metavar="PATH", help="write each turn's prefill_tokens, "
                   "new_tokens, ttft_ms and decode_tokens_per_sec as JSON, after every turn")
    cli.add_guided_options(p)
    return cli.one_line_errors(p)


def load(checkpoint_path: Path, *, max_new_tokens: int, max_seq_length: Optional[int] = None, device: str = "auto",
         dtype: str = "bfloat16", kv_cache_dtype: str = "auto", threads: Optional[int] = None,
         cpu_kernels: str = "auto", compile: bool = False, compile_prefill: bool = False,
         speculate: Optional[str] = "auto", speculate_k: int = 8, ngram: Optional[int] = None, max_nodes: int = 32,
         grammars: list[str] = (), **sampling):
    """The checked model, tokenizer and decode loop (speculate: as speculative.make_loop's, without a draft model;
    grammars: every reply matches them); every check runs before any weight is read."""
    dev, dt = generate.resolve_device(device), generate.DTYPES[dtype]
    config = checkpoint.plan(checkpoint_path, dev, dt)
    tokenizer = checkpoint.load_tokenizer(checkpoint_path, config)
    if tokenizer.chat_template is None:
        raise ValueError(f"{checkpoint_path} has no chat template (no chat_template.jinja or tokenizer_config.json "
                         f"chat_template beside its tokenizer), so it is not a chat model; for plain text use "
                         f"generate.py")
    length = max_seq_length or min(config.block_size, 4096)
    if length > config.block_size:
        raise ValueError(f"--max_seq_length {length} exceeds the model's block_size {config.block_size}")
    if max_new_tokens >= length:
        raise ValueError(f"--max_new_tokens {max_new_tokens} leaves no room for a prompt in a context of {length}")
    checkpoint.plan(checkpoint_path, dev, dt, 1, length, min(length, 2048), kv_int8=kv_cache_dtype == "int8")
    chosen = cli.set_threads(threads, 1) if dev.type == "cpu" else None
    speculate = None if speculate == "plain" or speculate == "auto" and grammars else speculate
    guide = guided.make_guide(tokenizer, list(grammars), 1, config.vocab_size, speculate_k if speculate else 0)
    model = checkpoint.load_model(checkpoint_path, dev, dt, cpu_kernels)
    model.setup_caches(1, length, generate.KV_DTYPES[kv_cache_dtype])
    backend = Backend(model, compile, compile_prefill)
    loop = speculative.make_loop(model, max_new_tokens=max_new_tokens, speculate=speculate, speculate_k=speculate_k,
                                 ngram=ngram, max_nodes=min(max_nodes, tree_nodes(length, max_new_tokens)), guide=guide,
                                 backend=backend, **sampling)
    print(f"Loaded {checkpoint_path} on {dev}{f' ({chosen} threads)' if chosen else ''}, {dtype}"
          f"{cli.kernels_of(model, dev) if dev.type == 'cpu' else ''}; context {length} tokens; running on "
          f"{backend.describe()}", file=sys.stderr)
    if compile or compile_prefill:
        t0 = time.perf_counter()  # one untimed reply compiles the steps (and records the CUDA graphs)
        loop([tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]), bos=False,
                               specials=True)])
        print(f"Compilation time: {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return model, tokenizer, loop


def tree_nodes(length: int, max_new_tokens: int) -> int:
    """The most nodes a token tree verifies: 32, or a quarter of the room a short context leaves the prompt."""
    return max(1, min(32, (length - max_new_tokens) // 4))


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    cli.sampling_options(p, args)
    grammars = ([guided.any_json()] if args.json else []) + (args.guides or [])
    if len(grammars) > 1:
        raise ValueError("give one of --json_schema, --json, --regex or --grammar: every reply matches it")
    if args.suffix and args.prompt_lookup:
        raise ValueError("use --suffix or --prompt_lookup, not both")
    speculate = "lookup" if args.prompt_lookup else "suffix" if args.suffix else args.speculate
    if args.speculate not in ("auto", speculate):
        raise ValueError(f"--speculate {args.speculate} and the flag forcing {speculate} ask for two methods; give one")
    if speculate in ("suffix", "lookahead") and grammars:
        raise ValueError(f"{speculate} decoding does not support guided generation; use --prompt_lookup")
    if args.checkpoint_path == CHAT_MODEL and not CHAT_MODEL.exists():
        raise ValueError(f"no --checkpoint_path, and no {CHAT_MODEL}: convert SmolLM2-135M-Instruct there as "
                         f"README.md's quick start does (scripts/convert_gguf.py), or name a chat model")
    if sys.stdin is None:  # started with standard input closed
        raise ValueError("standard input is closed: chat.py reads the messages from it")
    cli.check_output_file(args.metrics_json, "--metrics_json", '"turns"')
    interactive = sys.stdin.isatty()
    model, tokenizer, loop = load(
        args.checkpoint_path, max_new_tokens=args.max_new_tokens, max_seq_length=args.max_seq_length,
        device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, threads=args.threads,
        cpu_kernels=args.cpu_kernels, compile=args.compile, compile_prefill=args.compile_prefill,
        speculate=speculate, speculate_k=args.speculate_k, ngram=args.prompt_lookup, grammars=grammars,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    extra = {"lookup": args.speculate_k + 1, "plain": 0}.get(  # the slots a round writes past the reply
        speculate, tree_nodes(model.max_seq_length, args.max_new_tokens))
    chat, stats = Conversation(system=args.system), []
    if interactive:
        history()
        print("Type a message, or /help.", file=sys.stderr)
    armed = False  # Ctrl-C at the prompt once: a second one ends the chat
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            if not interactive or armed:
                raise
            armed = True
            print("\n(Ctrl-C again, /quit or Ctrl-D to leave)", file=sys.stderr)
            continue
        armed = False
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if not command(line.strip(), chat, stats, model):
                    break
                continue
            turn = answer(chat, line, tokenizer, model, loop, max_new_tokens=args.max_new_tokens, extra=extra,
                          stop=args.stop, ignore_eos=args.ignore_eos, stream=interactive)
        except ValueError as e:
            if not interactive:
                raise  # a script's bad line ends the run with one error line and status 2
            print(f"error: {cli.first_line(e)}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n(stopped; that reply is not kept)", file=sys.stderr)
            continue
        print("" if interactive else turn["text"], flush=True)
        if turn["incomplete"]:
            print("warning: the reply is incomplete: it reached --max_new_tokens before its grammar was complete",
                  file=sys.stderr)
        stats.append({k: v for k, v in turn.items() if k != "text"})
        if args.metrics_json:
            text = json.dumps({"turns": stats}, indent=2)
            cli.write_file(args.metrics_json, lambda tmp: tmp.write_text(text))


def history():
    """Up-arrow recalls earlier messages, also from earlier sessions."""
    try:
        import atexit
        import readline
    except ImportError:  # Windows has no readline: plain input still works
        return
    try:
        HISTORY.parent.mkdir(parents=True, exist_ok=True)
        if HISTORY.is_file():
            readline.read_history_file(HISTORY)
        atexit.register(lambda: readline.write_history_file(HISTORY))
    except OSError:
        pass  # an unwritable home: history for this session only


if __name__ == "__main__":
    cli.run_main(main)
