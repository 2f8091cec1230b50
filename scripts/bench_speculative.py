"""Speculative decoding benchmark, all in one run on one machine: plain greedy decoding against a draft model at
fixed K = 2, 4, 6 and 8 and at an adaptive length, prompt lookup, and the token trees (a draft tree, the same staged,
suffix decoding, lookahead decoding). On the built-in pair the prompts are held-out standard-library code; a target
with a chat template gets three instruct workloads instead. It prints the speedup, the accepted tokens per round and
the target passes per token, and times the pieces a round is made of (a draft step, a plain target step, a verify
pass over S positions), from which it predicts each fixed K's speedup: why a speedup is or is not there. Writes the
figures as JSON, and a bar chart beside them when matplotlib is installed."""
import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402
import generate as gen  # noqa: E402
import speculative  # noqa: E402
import trees  # noqa: E402
from checkpoint import load_model, load_tokenizer  # noqa: E402
from eval import read_texts, stdlib_files  # noqa: E402
from generate import DEFAULT_CHECKPOINT, DTYPES, resolve_device  # noqa: E402
from model import kv_bucket  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import timed as seconds  # noqa: E402  (median seconds per call)

DRAFT = DEFAULT_CHECKPOINT.parent / "stdlib-draft"
KS = (2, 4, 6, 8)


def configs(draft, k_max: int, ngram: int, nodes_max: tuple) -> dict:  # label -> keywords (None: plain)
    rows = {"plain": None}
    if draft is not None:
        rows.update({f"draft, K={k}": dict(k=k, draft=draft) for k in KS})
        rows[f"draft, adaptive K<={k_max}"] = dict(k=k_max, draft=draft, adaptive=True)
    rows[f"prompt lookup, n={ngram}, K<={k_max}"] = dict(k=k_max, ngram=ngram)
    for nodes in nodes_max:  # tree rows: k is the most nodes; each row keeps its measured verify costs
        if draft is not None:
            rows[f"draft tree, <={nodes} nodes"] = dict(k=nodes, tree="draft", draft=draft, sizer=trees.Sizer())
            rows[f"staged draft tree, <={nodes} nodes"] = dict(k=nodes, tree="staged", draft=draft, sizer=trees.Sizer())
        rows[f"suffix, <={nodes} nodes"] = dict(k=nodes, tree="suffix", sizer=trees.Sizer())
        rows[f"lookahead, <={nodes} nodes"] = dict(k=nodes, tree="lookahead", sizer=trees.Sizer())
    return rows


def prompt_sets(tokenizer: Tokenizer, n: int, length: int) -> dict:
    """Held-out code: a window from the middle of each of n held-out files. Copy-heavy: the same window followed by
    its own first quarter, so that continuing means copying, as when editing code that is in the prompt.
    Repetitive: generate.py's default prompt, whose greedy continuation by the built-in target falls into a loop."""
    ids = [tokenizer.encode(t) for t in read_texts(stdlib_files("heldout"), "the held-out split")]
    ids = [x for x in ids if len(x) >= 2 * length]
    picked = [ids[i * len(ids) // n] for i in range(n)]
    windows = [x[len(x) // 2 - length // 2 : len(x) // 2 + length // 2] for x in picked]
    bos = [tokenizer.bos_id]
    return {"held-out code": [bos + w for w in windows],
            "copy-heavy": [bos + w[: length * 3 // 4] + w[: length // 4] for w in windows],
            "repetitive": [tokenizer.encode("def fibonacci(n):", bos=True)]}


def chat_sets(tokenizer: Tokenizer, n: int, length: int) -> dict:
    """For an instruct model, three workloads on n held-out code windows of about `length` tokens. Continue code:
    the window alone, to be continued. Edit code: a request to return the window with one line added, so that the
    answer copies the prompt. Summarize, quoting: a request to explain the code quoting the lines that matter."""
    texts = [t for t in read_texts(stdlib_files("heldout"), "the held-out split")
             if len(tokenizer.encode(t)) > 2 * length]
    windows = []
    for t in (texts[i * len(texts) // n] for i in range(n)):
        ids = tokenizer.encode(t, bos=False)
        window = tokenizer.decode(ids[len(ids) // 2 - length // 2 : len(ids) // 2 + length // 2])
        windows.append(window[window.find("\n") + 1 :])  # from a line's start
    ask = lambda text: tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),  # noqa
                                        bos=False, specials=True)
    return {"continue code": [tokenizer.encode(w) for w in windows],
            "edit code": [ask(f"Add the comment `# reviewed` as the first line of this Python code and give back "
                              f"the whole code, otherwise unchanged:\n```python\n{w}\n```") for w in windows],
            "summarize, quoting": [ask(f"Explain what this Python code does, quoting the lines that matter:\n"
                                       f"```python\n{w}\n```") for w in windows]}


def decode_rate(model, prompt: list[int], new_tokens: int, kwargs, steps) -> tuple[float, dict]:
    """Greedy decode tokens/sec after the first token (prefill is the same for every row), and the statistics."""
    if kwargs is None:
        r = gen.generate(model, [prompt], new_tokens, None, steps=steps, temperature=0)
        return r.decode_tokens / r.decode_s, {}
    kw = dict(kwargs)
    if "tree" in kw:  # a fresh proposer per run: a repeat must not find its own earlier output
        staged = trees.Suffix() if kw["tree"] == "staged" else None
        proposer = trees.DraftTree(kw["draft"], steps.draft_tree, staged=staged) if "draft" in kw else \
            trees.Suffix() if kw["tree"] == "suffix" else trees.Lookahead()
        r = trees.tree_generate(model, prompt, new_tokens, proposer, kw["k"], steps=steps, sizer=kw["sizer"],
                                temperature=0)
    else:
        r = speculative.speculative_generate(model, prompt, new_tokens, kw.pop("k"), steps=steps,
                                             temperature=0, **kw)
    return r.decode_tokens / r.decode_s, r.metrics(0)


@torch.inference_mode()  # as the loops run (with autograd on, the CPU kernels step aside for torch's)
def step_costs(model, draft, pos: int, k_max: int, device, steps) -> dict:
    """Seconds for one plain target step, one draft step and one verify pass over S = 2 .. k_max + 1 positions."""
    cur, slot = torch.zeros(1, 1, dtype=torch.long, device=device), torch.tensor([pos], device=device)
    n = kv_bucket(pos + k_max + 1, model.max_seq_length)  # every pass reads the same cache length
    costs = {"target_step": seconds(lambda: steps.decode(model, cur, slot, None, n, temperature=0), 50, device)}
    if draft is not None:
        costs["draft_step"] = seconds(lambda: steps.draft(draft, cur, slot, n, temperature=0), 50, device)
    for s in range(2, max(k_max, *KS) + 2):
        tokens = torch.zeros(1, s, dtype=torch.long, device=device)
        slots = torch.arange(pos, pos + s, device=device)
        costs[f"verify_{s}"] = seconds(lambda: steps.verify(model, tokens, slots, n, temperature=0), 30, device)
    return costs


def predicted_speedup(k: int, hist: list[int], costs: dict) -> float:
    """Tokens per round over seconds per round, relative to one token per plain step. A round drafts k tokens,
    verifies k + 1 positions and, when all k are kept, feeds the last one to the draft."""
    rounds = sum(hist)
    tokens = 1 + sum(j * c for j, c in enumerate(hist)) / rounds
    cost = (k + hist[k] / rounds) * costs["draft_step"] + costs[f"verify_{k + 1}"]
    return tokens / cost * costs["target_step"]


def main():
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="the target (default: the "
                   "built-in one); one with a chat template runs the instruct workloads: continue code, edit code, "
                   "summarize quoting")
    p.add_argument("--draft_checkpoint_path", type=Path, help="the draft (default: the built-in one for the built-in "
                   "target, else none, and no draft rows)")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weight and activation dtype")
    p.add_argument("--prompts", type=cli.positive_int, default=4, help="prompts per set")
    p.add_argument("--prompt_tokens", type=cli.positive_int, default=256, help="tokens per prompt")
    p.add_argument("--new_tokens", type=cli.positive_int, default=128, help="tokens generated per run")
    p.add_argument("--repeats", type=cli.positive_int, default=3, help="timed runs per row and prompt; the median "
                   "is reported")
    p.add_argument("--k_max", type=cli.positive_int, default=8, help="the adaptive rule's and prompt lookup's "
                   "largest K")
    p.add_argument("--ngram", type=cli.positive_int, default=3, help="prompt lookup's n-gram")
    p.add_argument("--nodes", type=cli.positive_int, nargs="+", default=[32], help="the token-tree rows' most nodes "
                   "per verify pass, one row per value (each pass takes the size its measured costs favour)")
    p.add_argument("--compile", action="store_true", help="compile the steps, as generate.py --compile does")
    p.add_argument("--quick", action="store_true", help="a check that everything runs, in about a minute: one "
                   "prompt per set, 64 prompt tokens, 32 new tokens, one timed run; its figures are rough")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    p.add_argument("--json", type=Path, default=Path("bench_speculative.json"), help="where to write the figures "
                   "(and, with matplotlib installed, a bar chart of the speedups beside it, as .png)")
    args = cli.one_line_errors(p).parse_args()
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    cli.check_output_file(args.json, "--json", '"machine"')
    cli.check_output_file(args.json.with_suffix(".png"), "--json", "Matplotlib")
    if device.type == "cpu":
        cli.set_threads(args.threads)
    if args.quick:
        args.prompts, args.prompt_tokens, args.new_tokens, args.repeats = 1, 64, 32, 1
    torch.manual_seed(0)
    model = load_model(args.checkpoint_path, device, dtype)
    tokenizer = load_tokenizer(args.checkpoint_path, model.args)
    draft_path = args.draft_checkpoint_path or (DRAFT if args.checkpoint_path == DEFAULT_CHECKPOINT else None)
    draft = load_model(draft_path, device, dtype) if draft_path else None
    sets = (chat_sets if tokenizer.chat_template else prompt_sets)(tokenizer, args.prompts, args.prompt_tokens)
    rows = configs(draft, args.k_max, args.ngram, tuple(args.nodes))
    steps = gen.build_steps(args.compile)
    longest = max(len(p) for ps in sets.values() for p in ps)
    room = trees.DraftTree(draft, staged=trees.Suffix()).room  # a staged draft tree's cache slots past the root
    length = longest + args.new_tokens + max(args.k_max + 1, *args.nodes, room)
    for m in (model, draft) if draft is not None else (model,):
        m.setup_caches(1, length)  # one cache size for every row: no row recompiles for another's shapes
    t0 = time.perf_counter()
    for kwargs in rows.values():  # warm-up, and compilation
        decode_rate(model, next(iter(sets.values()))[0], 16, kwargs, steps)
    compile_s = time.perf_counter() - t0
    # rates[set][label][prompt] = list over repeats; rows are interleaved so that drift in the machine hits all alike
    rates = {s: {label: [[] for _ in ps] for label in rows} for s, ps in sets.items()}
    stats = {s: {label: [] for label in rows} for s in sets}
    for _ in tqdm(range(args.repeats), desc="timed rounds", disable=None):
        for s, ps in sets.items():
            for i, prompt in enumerate(ps):
                for label, kwargs in rows.items():
                    rate, st = decode_rate(model, prompt, args.new_tokens, kwargs, steps)
                    rates[s][label][i].append(rate)
                    stats[s][label].append(st)
    costs = step_costs(model, draft, args.prompt_tokens, args.k_max, device, steps)
    results = {"checkpoint": str(args.checkpoint_path), "draft": str(draft_path) if draft_path else None,
               "machine": machine(device), "dtype": args.dtype, "compile": args.compile, "compile_s": compile_s,
               "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "repeats": args.repeats, "costs_ms": {k: 1e3 * v for k, v in costs.items()}, "sets": {}}
    for s in sets:
        results["sets"][s] = {}
        for label, kwargs in rows.items():
            # per prompt, the median over repeats; over the set, tokens over time (prompts have equal lengths)
            med = [statistics.median(r) for r in rates[s][label]]
            row = {"tokens_per_sec": len(med) / sum(1 / r for r in med)}
            if kwargs is not None:
                sts = stats[s][label]
                bins = max(len(st["accept_histogram"]) for st in sts)
                hist = [sum(st["accept_histogram"][j] for st in sts if j < len(st["accept_histogram"]))
                        for j in range(bins)]
                rounds, drafted = sum(hist), sum(st["mean_drafted"] * sum(st["accept_histogram"]) for st in sts)
                kept = sum(j * c for j, c in enumerate(hist))
                row.update(mean_drafted=drafted / rounds, mean_accepted=kept / rounds,
                           acceptance_rate=kept / drafted if drafted else 0.0, accept_histogram=hist,
                           passes_per_token=rounds / (rounds + kept))  # a round emits its kept tokens and one more
                if kwargs.get("draft") is not None and not kwargs.get("adaptive") and "tree" not in kwargs:
                    row["predicted_speedup"] = predicted_speedup(kwargs["k"], hist, costs)
            results["sets"][s][label] = row
        plain = results["sets"][s]["plain"]["tokens_per_sec"]
        for row in results["sets"][s].values():
            row["speedup"] = row["tokens_per_sec"] / plain
    print_tables(results)
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=2)))
    print(f"wrote {args.json}")
    if importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed")
    else:
        cli.write_file(args.json.with_suffix(".png"), lambda tmp: plot(results, tmp))
        print(f"wrote {args.json.with_suffix('.png')}")


def machine(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = Path("/proc/cpuinfo")
    names = [l.split(":", 1)[1].strip() for l in info.read_text().splitlines() if l.startswith("model name")] \
        if info.exists() else []
    return f"{names[0] if names else platform.processor()}, {torch.get_num_threads()} threads"


def print_tables(r: dict):
    print(f"\n{r['checkpoint']}, draft {r['draft']}; {r['machine']}, {r['dtype']}, "
          f"{'compiled' if r['compile'] else 'eager'}, torch {torch.__version__}: "
          f"{r['prompts']} prompts per set of {r['prompt_tokens']} tokens, {r['new_tokens']} new tokens, greedy, "
          f"median of {r['repeats']}; compile and warm-up {r['compile_s']:.0f} s\n")
    for s, rows in r["sets"].items():
        print(f"**{s}**\n")
        print("| | tokens/s | speedup | drafted / round | accepted / round | target passes / token | acceptance "
              "| predicted speedup |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, row in rows.items():
            cells = [f"{row['tokens_per_sec']:.1f}", f"{row['speedup']:.2f}x"]
            cells += [f"{row[k]:.2f}" for k in ("mean_drafted", "mean_accepted", "passes_per_token")] \
                if "mean_drafted" in row else ["", "", "1.00"]
            cells.append(f"{row['acceptance_rate']:.0%}" if "acceptance_rate" in row else "")
            cells.append(f"{row['predicted_speedup']:.2f}x" if "predicted_speedup" in row else "")
            print(f"| {label} | " + " | ".join(cells) + " |")
        print()
    c = r["costs_ms"]
    verify = ", ".join(f"{s.split('_')[1]}: {v / c['target_step']:.2f}" for s, v in c.items() if s.startswith("verify"))
    draft = f"draft step {c['draft_step'] / c['target_step']:.2f}; " if "draft_step" in c else ""
    print(f"Costs, as fractions of one plain target step ({c['target_step']:.2f} ms): {draft}verify pass over S "
          f"positions, S = {verify}")


def plot(r: dict, path: Path):
    """Speedup over plain decoding, a group of bars per workload and a bar per proposer."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    sets, labels = list(r["sets"]), [label for label in next(iter(r["sets"].values())) if label != "plain"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) * len(sets) / 3), 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(sets))]
        ax.bar(xs, [r["sets"][s][label]["speedup"] for s in sets], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("speedup over plain greedy decoding")
    ax.set_title(f"{Path(r['checkpoint']).name}, {r['dtype']}: {r['machine']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


if __name__ == "__main__":
    cli.run_main(main)
