"""lm-evaluation-harness against serve.py through its local-completions model, as its users run it: a
multiple-choice task (loglikelihoods: echo with logprobs) and a generate_until task, from a local task file, with
the server's tokenizer (its remote backend, found through /tokenizer_info). The scores must be what the model
computes directly."""
import json

import pytest
import torch

from test_serve import BUILTIN, serving
from test_serve_logprobs import full_logprobs, greedy

lm_eval = pytest.importorskip("lm_eval", reason="needs: pip install 'lm-eval[api]' (a test dependency)")

CHOICES = [  # (context, choices, the right one)
    ("import", [" os", " banana", " 42"], 0),
    ("def add(a, b):\n    return", [" a + b", " the moon", " nothing at all"], 0),
    ("for i in", [" range(10):", " elephant", " ((("], 0),
    ("class Stack:\n    def", [" __init__(self):", " blue", " ;;"], 0),
    ("x = [1, 2, 3]\nprint(len(", ["x))", "house))", "][)"], 0),
    ("if __name__ ==", [' "__main__":', " 7 7 7", " pass pass"], 0),
]
PROMPTS = ["def fibonacci(n):", "import sys\n", "class Point:"]


def task_files(folder) -> None:
    """Two tasks in lm-eval's YAML over local JSON Lines files."""
    (folder / "choice.jsonl").write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n"
                                                 for c, ch, a in CHOICES))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in PROMPTS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "fd_choice.yaml").write_text(
        f"task: fd_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    (folder / "fd_gen.yaml").write_text(
        f"task: fd_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


def loglikelihood(llm, context: str, continuation: str) -> float:
    """The continuation's log-probability after the context, tokenized as lm-eval does (the pair's tokens, the
    context's first; no BOS), from one forward of the model."""
    whole = llm.tokenizer.encode(context + continuation, bos=False)
    n = len(llm.tokenizer.encode(context, bos=False))
    lp = full_logprobs(llm, whole)
    return sum(lp[i - 1, whole[i]].item() for i in range(n, len(whole)))


def evaluate(tmp_path_factory, dtype: str, tasks: list[str]) -> dict:
    """lm-eval's results and logged samples over HTTP to a server of that dtype, 4 requests a batch."""
    from lm_eval.tasks import TaskManager
    folder = tmp_path_factory.mktemp("tasks")
    task_files(folder)
    with serving(BUILTIN, tmp_path_factory.mktemp("serve"), "--dtype", dtype) as s:
        return lm_eval.simple_evaluate(
            model="local-completions", model_args={"base_url": f"{s.url}/completions", "model": "stdlib-target",
                                                   "tokenizer_backend": "remote", "max_retries": 1},
            tasks=tasks, task_manager=TaskManager(include_path=str(folder)), batch_size=4, log_samples=True)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    return evaluate(tmp_path_factory, "float32", ["fd_choice", "fd_gen"])


@pytest.fixture(scope="module")
def direct():
    from fast_decode import LLM
    return LLM(BUILTIN, dtype="float32", threads=1)


def test_multiple_choice_loglikelihoods_over_http_equal_the_models_within_1e_4(evaluated, direct):
    samples = sorted(evaluated["samples"]["fd_choice"], key=lambda s: s["doc_id"])
    assert len(samples) == len(CHOICES)
    for (context, choices, _), sample in zip(CHOICES, samples):
        got = [resp[0][0] for resp in sample["resps"]]
        want = [loglikelihood(direct, context, c) for c in choices]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (context, got, want)


def test_multiple_choice_accuracy_over_http_is_the_models_own(evaluated, direct):
    right = [max(range(len(ch)), key=lambda j: loglikelihood(direct, c, ch[j])) == a for c, ch, a in CHOICES]
    assert evaluated["results"]["fd_choice"]["acc,none"] == pytest.approx(sum(right) / len(right))


def test_generate_until_answers_are_the_models_greedy_text_cut_at_the_stop(evaluated, direct):
    samples = sorted(evaluated["samples"]["fd_gen"], key=lambda s: s["doc_id"])
    for prompt, sample in zip(PROMPTS, samples):
        ids = direct.tokenizer.encode(prompt, bos=False)
        text = direct.tokenizer.decode(ids + greedy(direct, ids, 12), specials=False)[len(prompt):]
        assert sample["resps"][0][0] == text.split("\n\n")[0]



def test_bf16_over_http_picks_the_same_choice_as_the_float32_model_on_every_item(tmp_path_factory, direct):
    """bfloat16 on the CPU kernels (the C++ step scoring each prompt token as a row of its own)."""
    samples = sorted(evaluate(tmp_path_factory, "bfloat16", ["fd_choice"])["samples"]["fd_choice"],
                     key=lambda s: s["doc_id"])
    for (context, choices, _), sample in zip(CHOICES, samples):
        got = [resp[0][0] for resp in sample["resps"]]
        want = [loglikelihood(direct, context, c) for c in choices]
        assert got.index(max(got)) == want.index(max(want)) and max(abs(a - b) for a, b in zip(got, want)) < 0.5
