"""The built-in models trained on the Python standard library, their training script, and eval.py."""
import re
import sys
from pathlib import Path

import pytest
import torch

from eval import perplexity, stdlib_files
from checkpoint import load_model
from generate import generate
from launcher import command
from tokenizer import Tokenizer
from conftest import errors_of

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = {name: ROOT / "checkpoints" / f"stdlib-{name}" for name in ("target", "draft")}
CARD = ROOT / "checkpoints" / "README.md"
N_FILES = 5  # the model card records perplexity on the first 5 held-out files


def run(script, *args, timeout=600):
    return command(script, *args, timeout=timeout, text=True)


def recorded_perplexity(name):
    match = re.search(rf"{name}, first {N_FILES} held-out files: \*\*([0-9.]+)\*\*", CARD.read_text())
    assert match, f"the model card has no perplexity line for the {name}"
    return float(match.group(1))


def heldout_perplexity(name, n_files=None):
    path = CHECKPOINTS[name]
    texts = [f.read_text(encoding="utf-8") for f in stdlib_files("heldout")[:n_files]]
    return perplexity(load_model(path, "cpu", torch.float32), Tokenizer(path / "tokenizer.model"), texts)[0]


def test_generate_works_out_of_the_box_with_the_builtin_model():
    result = run("generate.py", "--max_new_tokens", 40, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("def fibonacci(n):") == 1 and "tokens/sec" in result.stdout


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_builtin_checkpoint_continues_a_function_with_an_indented_body(name):
    path = CHECKPOINTS[name]
    model, tokenizer = load_model(path, "cpu", torch.bfloat16), Tokenizer(path / "tokenizer.model")
    rows = generate(model, [tokenizer.encode("def fibonacci(n):\n")], 30, eos_ids=tokenizer.eos_ids, temperature=0.0).rows
    assert tokenizer.decode(rows[0]).startswith("    ")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_heldout_perplexity_is_within_5_percent_of_the_model_card(name):
    assert heldout_perplexity(name, N_FILES) == pytest.approx(recorded_perplexity(name), rel=0.05)


def test_target_beats_draft_and_both_beat_a_unigram_model_by_far():
    # on the first 20 held-out files (83k tokens, half the split): on a handful the two can come out in either order
    # (on the first 10 the draft is ahead), and the whole split costs a minute more for the same verdict
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_tiny import encode_corpus, unigram_perplexity
    tokenizer = Tokenizer(CHECKPOINTS["target"] / "tokenizer.model")
    train = encode_corpus(tokenizer, [f.read_text(encoding="utf-8") for f in stdlib_files("train")])
    heldout = encode_corpus(tokenizer, [f.read_text(encoding="utf-8") for f in stdlib_files("heldout")[:20]])
    unigram = unigram_perplexity(train, heldout, tokenizer.vocab_size)
    assert heldout_perplexity("target", 20) < heldout_perplexity("draft", 20) < unigram / 5


def test_train_and_heldout_splits_are_disjoint_and_leave_out_tests_and_site_packages():
    train, heldout = set(stdlib_files("train")), set(stdlib_files("heldout"))
    assert train and heldout and not train & heldout
    assert not any({"test", "tests", "site-packages", "pydoc_data"} & set(f.parts) for f in train | heldout)


def test_training_smoke_run_lowers_the_loss_and_is_deterministic(tmp_path):
    weights = []
    for run_dir in (tmp_path / "a", tmp_path / "b"):
        result = run("scripts/train_tiny.py", "--smoke", "--vocab_size", 400, "--out_dir", run_dir)
        assert result.returncode == 0, result.stderr
        losses = [float(x) for x in re.findall(r"target step +\d+/\d+ loss ([0-9.]+)", result.stdout)]
        assert losses[-1] < losses[0] - 0.3
        assert "ETA" in result.stdout and "tokens/s" in result.stdout
        weights.append((run_dir / "stdlib-target" / "model.safetensors").read_bytes())
    assert weights[0] == weights[1]
    model = load_model(tmp_path / "a" / "stdlib-draft", "cpu", torch.float32)
    assert model.args.vocab_size == 400


def test_eval_cli_reports_tokens_perplexity_and_draft_agreement():
    result = run("eval.py", "--max_files", 1, "--draft", CHECKPOINTS["draft"])
    assert result.returncode == 0, result.stderr
    assert re.search(r"\d+ tokens evaluated, perplexity [0-9.]+", result.stdout)
    assert 0.2 < float(re.search(r"greedy agreement with .*: ([0-9.]+)", result.stdout).group(1)) < 1.0


@pytest.mark.parametrize("content, message", [(None, "not found"), ("", "no text"), ("  \n", "no text"),
                                              ("x", "shorter than 2 tokens")])
def test_eval_cli_bad_text_gets_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_text(content)
    result = run("eval.py", "--text", path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = errors_of(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_training_refuses_to_overwrite_the_shipped_checkpoints():
    before = (CHECKPOINTS["target"] / "model.safetensors").read_bytes()
    result = run("scripts/train_tiny.py", "--smoke")
    assert result.returncode != 0 and result.stderr.startswith("error:") and "--force" in result.stderr
    assert (CHECKPOINTS["target"] / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("args, message", [(("--batch_size", 0), "--batch_size"),
                                           (("--vocab_size", 10), "--vocab_size")])
def test_training_bad_argument_gets_a_one_line_error(tmp_path, args, message):
    result = run("scripts/train_tiny.py", "--smoke", "--out_dir", tmp_path, *args)
    lines = errors_of(result.stderr)
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
