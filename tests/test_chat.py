"""chat.py: a conversation on standard input, one reply per line, with the KV cache kept between turns."""
import json
from pathlib import Path

from checkpoint import load_tokenizer, read_config
from conftest import errors_of
from launcher import command


def chat(ckpt, lines, *flags, tmp=None):
    metrics = (tmp / "m.json") if tmp else None
    cmd = ["chat.py", "--checkpoint_path", str(ckpt), "--temperature", "0", "--max_new_tokens", "6", *flags] + (["--metrics_json", str(metrics)] if metrics else [])
    r = command(*cmd, stdin=("\n".join(lines) + "\n").encode(), timeout=600, text=True)
    turns = json.loads(metrics.read_text())["turns"] if metrics and metrics.exists() else None
    return r, turns


def test_second_turn_prefills_only_its_new_tokens(chat_checkpoint, tmp_path):
    r, turns = chat(chat_checkpoint, ["the quick brown fox", "jumps over the lazy dog"], tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(chat_checkpoint, read_config(chat_checkpoint))
    first = tok.encode(tok.apply_chat_template([{"role": "user", "content": "the quick brown fox"}]),
                       bos=False, specials=True)
    assert turns[0]["prefill_tokens"] == len(first)
    new_message = len(tok.encode("jumps over the lazy dog", bos=False))
    # the new message and the template's few tokens around it; the first turn is not computed again
    assert new_message <= turns[1]["prefill_tokens"] <= turns[1]["context_tokens"] - len(first)
    assert len(r.stdout.splitlines()) >= 2 and all(t["new_tokens"] >= 1 for t in turns)


def test_full_context_drops_the_oldest_exchange_and_goes_on(chat_checkpoint, tmp_path):
    lines = ["the quick brown fox jumps over the lazy dog"] * 4
    r, turns = chat(chat_checkpoint, lines, "--max_seq_length", "80", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "dropped the oldest" in r.stderr and len(turns) == 4
    assert max(t["context_tokens"] for t in turns) <= 80


def test_prompt_lookup_gives_the_same_greedy_replies(chat_checkpoint):
    lines = ["def f(x): return x + 1", "def f(x): return x + 1"]
    plain, _ = chat(chat_checkpoint, lines, "--speculate", "plain")
    guessed, _ = chat(chat_checkpoint, lines, "--prompt_lookup", "2", "--speculate_k", "4")
    assert guessed.returncode == 0, guessed.stderr
    assert guessed.stdout == plain.stdout


def test_suffix_decoding_gives_the_same_greedy_replies_across_turns(chat_checkpoint):
    # on the CPU: bit-equal replies need a verify pass to round as one-token steps do; in bf16 on a GPU, a pass of
    # several tokens multiplies with other kernels, and on this random model a near tie then flips
    lines = ["def f(x): return x + 1", "def f(x): return x + 1", "and again: def f(x): return x + 1"]
    plain, _ = chat(chat_checkpoint, lines, "--device", "cpu", "--speculate", "plain")
    guessed, _ = chat(chat_checkpoint, lines, "--device", "cpu", "--suffix")
    assert guessed.returncode == 0, guessed.stderr
    assert guessed.stdout == plain.stdout


def test_by_default_replies_choose_their_method_and_equal_plain_greedy_ones(chat_checkpoint, tmp_path):
    lines = ["def f(x): return x + 1", "def f(x): return x + 1", "and again: def f(x): return x + 1"]
    plain, _ = chat(chat_checkpoint, lines, "--device", "cpu", "--speculate", "plain", "--max_new_tokens", "24")
    auto, turns = chat(chat_checkpoint, lines, "--device", "cpu", "--max_new_tokens", "24", tmp=tmp_path)
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout == plain.stdout
    # every token after the first, the end-of-sequence one included where a reply ends with it
    assert all(sum(t["methods"].values()) in (t["new_tokens"] - 1, t["new_tokens"]) for t in turns)


def test_suffix_with_prompt_lookup_is_one_line_of_error(chat_checkpoint):
    r, _ = chat(chat_checkpoint, ["hi"], "--suffix", "--prompt_lookup", "2")
    assert r.returncode != 0 and errors_of(r.stderr) == ["error: use --suffix or --prompt_lookup, not both"]


def test_compiled_chat_gives_the_same_greedy_replies(chat_checkpoint):
    lines = ["the quick brown fox", "print the value"]
    plain, _ = chat(chat_checkpoint, lines, "--dtype", "float32", "--speculate", "plain")  # bf16 rounds differently compiled
    compiled, _ = chat(chat_checkpoint, lines, "--dtype", "float32", "--compile")
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == plain.stdout


def test_save_and_load_restore_the_conversation(chat_checkpoint, tmp_path):
    saved = tmp_path / "talk.json"
    r, _ = chat(chat_checkpoint, ["/system Be brief.", "the quick brown fox", f"/save {saved}"])
    assert r.returncode == 0, r.stderr
    data = json.loads(saved.read_text())
    assert data["system"] == "Be brief." and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    r2, _ = chat(chat_checkpoint, [f"/load {saved}", f"/save {tmp_path / 'again.json'}"])
    assert json.loads((tmp_path / "again.json").read_text()) == data


def test_a_bad_line_in_a_script_is_one_error_and_status_2(chat_checkpoint, tmp_path):
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "wizard"}]}')
    r, _ = chat(chat_checkpoint, [f"/load {tmp_path / 'bad.json'}"])
    assert r.returncode == 2 and errors_of(r.stderr)[-1:] == [f"error: {tmp_path / 'bad.json'} is not a "
                                                              f"conversation saved by /save"]


def test_a_model_without_chat_template_is_refused(checkpoint):
    r, _ = chat(checkpoint, ["hello"])
    [line] = errors_of(r.stderr)
    assert r.returncode == 2 and "no chat template" in line and "generate.py" in line and "--chat" not in line


def test_standard_input_closed_is_one_line(chat_checkpoint):
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "chat.py", "--checkpoint_path", chat_checkpoint], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent, preexec_fn=lambda: os.close(0))
    assert r.returncode == 2 and errors_of(r.stderr) == ["error: standard input is closed: chat.py reads the messages "
                                                         "from it"]


class Terminal:
    """Standard input as a terminal: what chat.py checks before it streams and keeps going after an error."""

    def isatty(self):
        return True


def chat_at_a_terminal(monkeypatch, capsys, ckpt, typed, stop_reply=None):
    """chat.main in this process as if typed at a terminal: each of typed is a line entered, or KeyboardInterrupt
    for Ctrl-C at the prompt; the reply to the line stop_reply gets Ctrl-C while it is written (at its first
    streamed text). -> (standard error, each line's reply tokens as last streamed)."""
    import builtins
    import sys

    import chat as chat_py
    import cli
    lines, real, current, replies = iter(typed), cli.make_streamer, {}, {}

    def enter(prompt=""):
        line = next(lines)
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        current["line"] = line
        return line

    def streamer(tokenizer, prompt, eos_ids=None):
        shown = real(tokenizer, prompt, eos_ids)

        def stream(tokens):
            shown(tokens)
            replies[current["line"]] = list(tokens)
            if current["line"] == stop_reply:
                raise KeyboardInterrupt
        return stream
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr(builtins, "input", enter)
    monkeypatch.setattr(cli, "make_streamer", streamer)
    monkeypatch.setattr(chat_py, "history", lambda: None)
    chat_py.main(["--checkpoint_path", str(ckpt), "--temperature", "0", "--max_new_tokens", "12", "--ignore_eos"])
    return capsys.readouterr().err, replies


def test_ctrl_c_stops_the_reply_being_written_and_the_conversation_goes_on_without_it(chat_checkpoint, monkeypatch,
                                                                                      capsys):
    err, replies = chat_at_a_terminal(monkeypatch, capsys, chat_checkpoint, ["the quick brown fox", "jumps over",
                                      "the lazy dog", "/quit"], stop_reply="jumps over")
    assert "(stopped; that reply is not kept)" in err and len(replies["jumps over"]) < 12
    _, plain = chat_at_a_terminal(monkeypatch, capsys, chat_checkpoint, ["the quick brown fox", "the lazy dog",
                                  "/quit"])  # the same conversation, never interrupted
    assert replies["the lazy dog"] == plain["the lazy dog"] and len(plain["the lazy dog"]) == 12


def test_ctrl_c_at_the_prompt_asks_for_a_second_one_to_leave(chat_checkpoint, monkeypatch, capsys):
    import pytest
    err, _ = chat_at_a_terminal(monkeypatch, capsys, chat_checkpoint, [KeyboardInterrupt, "/quit"])
    assert "(Ctrl-C again, /quit or Ctrl-D to leave)" in err
    with pytest.raises(KeyboardInterrupt):
        chat_at_a_terminal(monkeypatch, capsys, chat_checkpoint, [KeyboardInterrupt, KeyboardInterrupt])


def test_without_a_checkpoint_it_takes_the_quick_starts_chat_model_or_says_how_to_make_it(monkeypatch, tmp_path):
    import pytest

    import chat as chat_py
    monkeypatch.setattr(chat_py, "CHAT_MODEL", tmp_path / "SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="convert SmolLM2-135M-Instruct there as README.md's quick start does"):
        chat_py.main([])
