"""Run a data set through a model: every prompt of a file, many at a time on one paged KV cache (engine.py), each
answer written as a line of JSON.

    python batch.py --prompts_file questions.txt --output answers.jsonl --temperature 0

--prompts_file holds one prompt per line, or JSON Lines, each {"prompt": "...", ...} with its own options if it
wants them (max_new_tokens, temperature, top_k, top_p, min_p, the penalties, logit_bias, logprobs, seed, stop,
json_schema, regex, ...). A prompt that cannot run (too long, a bad schema) gets "finish_reason": "error" and its
error; the others run. When none could run, the answers are still written and the exit status is 2."""
import argparse
import json
import sys
import time
from pathlib import Path

import cli


def read_prompts(path: Path) -> list:
    """The file's prompts: str per line, or dicts (JSON Lines); blank lines skipped."""
    text = sys.stdin.read() if str(path) == "-" else cli.check_text_file(path, "--prompts_file").read_text()
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"--prompts_file {path} holds no prompt")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts = []
    for i, line in lines:
        try:
            p = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts_file {path} line {i}: not JSON ({e.msg})") from None
        if not isinstance(p, dict) or not isinstance(p.get("prompt"), str):
            raise ValueError(f"--prompts_file {path} line {i}: each line needs a \"prompt\" string")
        prompts.append(p)
    return prompts


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--prompts_file", type=Path, required=True, help="one prompt per line, or JSON Lines of "
                   "{\"prompt\": ..., options}; - reads standard input")
    p.add_argument("--output", type=Path, help="where to write the answers as JSON Lines (default: standard output); "
                   "an existing file is never overwritten")
    p.add_argument("--checkpoint_path", type=Path, default=cli.DEFAULT_CHECKPOINT, help="the model's folder")
    cli.add_sampling_options(p, default_seed=None)  # (the seed: each request's, the same for every prompt)
    p.add_argument("--min_p", type=cli.finite_float, default=0.0, help="drop tokens less likely than this times the "
                   "likeliest (after temperature), in [0, 1]")
    for name, what in (("presence", "once if the answer holds it"), ("frequency", "once per time the answer holds it")):
        p.add_argument(f"--{name}_penalty", type=cli.finite_float, default=0.0, help=f"subtracted from a token's "
                       f"logit {what}, -2 to 2")
    p.add_argument("--repetition_penalty", type=cli.finite_float, default=1.0, help="divides the positive logits of "
                   "the tokens in prompt or answer (multiplies the negative), > 0; 1: none")
    p.add_argument("--logprobs", type=cli.whole_or_zero, help="write each new token's log-probability and this many "
                   "likeliest alternatives (the model's own distribution, before temperature and penalties)")
    p.add_argument("--chat", action="store_true", help="each prompt as a user turn in the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    p.add_argument("--concurrency", type=cli.positive_int, default=16, help="requests decoding at once")
    p.add_argument("--kv_blocks", type=cli.positive_int, help="KV cache blocks of 16 tokens (default: room for "
                   "--concurrency requests of 40%% of the context each; more requests wait or are recomputed)")
    p.add_argument("--max_seq_length", type=cli.positive_int, help="the context: prompt + answer, at most")
    cli.add_device_options(p)
    args = cli.one_line_errors(p).parse_args(argv)
    cli.sampling_options(p, args)
    if args.output is not None and args.output.exists():
        raise ValueError(f"--output {args.output} exists: give a new path (nothing is overwritten)")
    prompts = read_prompts(args.prompts_file)
    from engine import Engine
    from fast_decode import LLM
    llm = LLM(args.checkpoint_path, device=args.device, dtype=args.dtype, max_seq_length=args.max_seq_length,
              threads=args.threads, cpu_kernels=args.cpu_kernels)
    llm.engine = Engine(llm.model, llm.tokenizer, blocks=args.kv_blocks, max_rows=args.concurrency)
    t0 = time.perf_counter()
    answers = llm.generate_many(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos, chat=args.chat, system=args.system,
                                progress=sys.stderr.isatty(), **cli.engine_sampling(args))
    seconds = time.perf_counter() - t0
    lines = "".join(json.dumps({"prompt": q if isinstance(q, str) else q["prompt"], "text": a.text,
                                "finish_reason": a.finish_reason, **({"error": a.error} if a.error else {}),
                                **({"logprobs": a.logprobs} if a.logprobs is not None else {}),
                                "usage": a.metrics}) + "\n" for q, a in zip(prompts, answers))
    if args.output is None:
        sys.stdout.write(lines)
    else:
        cli.write_file(args.output, lambda tmp: tmp.write_text(lines))
    s, pool = llm.engine.stats, llm.engine.pool
    print(f"{len(prompts)} requests ({sum(a.error is not None for a in answers)} refused) in {seconds:.2f} s: "
          f"{s['generated'] / seconds:.1f} new tokens/s; {s['prompt_tokens']} prompt tokens, {s['cached_tokens']} "
          f"of them from the prefix cache; peak KV {s['peak_blocks']} of {pool.n_blocks} blocks "
          f"({s['peak_blocks'] * llm.engine.passes.cache.bytes_per_block() / 1e6:.1f} MB); {s['preempted']} preemptions",
          file=sys.stderr)
    refused = [a.error for a in answers if a.error is not None]
    if len(refused) == len(answers):  # the answers are written, but nothing ran: a failure for whoever called
        raise ValueError(f"every request was refused; the first: {refused[0]}")


if __name__ == "__main__":
    cli.run_main(main)
