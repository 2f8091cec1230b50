"""Guided generation: outputs match JSON schemas, regexes and Lark grammars, greedy and sampled, in batches with a
grammar per row, under speculation, compiled, quantized, and through the command lines; the masked sampling keeps
the model's distribution over the allowed tokens."""
import ast
import json
import random
import re
from pathlib import Path

import pytest
import torch

import guided
from checkpoint import load_model, load_tokenizer, read_config
from conftest import errors_of, needs_smollm2
from backend import Backend
from generate import allowed as allowed_tokens, generate
from sampling import Sampling, pick
from launcher import command
from speculative import speculative_generate

jsonschema = pytest.importorskip("jsonschema")
ROOT = Path(__file__).resolve().parent.parent
BUILTIN, DRAFT = ROOT / "checkpoints" / "stdlib-target", ROOT / "checkpoints" / "stdlib-draft"
NAMES = ["id", "name", "age", "tags", "price", "count", "active", "kind", "items", "owner", "size", "color", "score",
         "title", "level", "note"]
WORDS = ["red", "green", "blue", "small", "large", "alpha", "beta", "on", "off"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                       "maxItems": 4}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
ARITHMETIC = """start: expr
expr: term (OP term)~0..3
term: NUMBER | "(" expr ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[0-9]{1,3}/
"""


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects with required and optional fields, arrays, enums, bounded integers and numbers, strings, booleans.
    Numbers carry a multipleOf: an unbounded fraction lets a small model write zeros until its budget ends."""
    kind = "object" if depth == 0 else rng.choice(["integer", "number", "string", "boolean", "enum"]
                                                  + (["object", "array"] * 2 if depth < 2 else []))
    if kind == "object":
        keys = rng.sample(NAMES, rng.randint(1, 4))
        return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in keys},
                "required": [k for k in keys if rng.random() < 0.6], "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4)) + ([rng.randint(0, 9)] if rng.random() < 0.3 else [])}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100),
                "multipleOf": rng.choice([0.5, 0.25, 0.125])}  # exact in binary: jsonschema checks in floats
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    return {"type": "boolean"}


SCHEMAS = [random_schema(random.Random(i)) for i in range(50)]  # each at most 232 characters (escapes aside): 256 tokens fit


@pytest.fixture(scope="module")
def builtin():
    return load_model(BUILTIN, torch.device("cpu"), torch.bfloat16), load_tokenizer(BUILTIN, read_config(BUILTIN))


@pytest.fixture(scope="module")
def builtin_f32():  # exact comparisons between loops: float32, so one pass over S tokens equals S single steps
    return (load_model(BUILTIN, torch.device("cpu"), torch.float32, "off"),
            load_model(DRAFT, torch.device("cpu"), torch.float32, "off"), load_tokenizer(BUILTIN, read_config(BUILTIN)))


@pytest.fixture(scope="module")
def smollm2(smollm2_imports):
    """SmolLM2-135M-Instruct with the GGUF's Q4_1 weights kept as int4."""
    return smollm2_imports["int4"]


def run(script, *args, stdin=None):
    r = command(script, *args, stdin=stdin and stdin.encode(), timeout=600, text=True)
    assert r.returncode == 0, r.stderr
    return r


def guide(model, tokenizer, grammars, batch=None, k=0):
    return guided.Guide(tokenizer, grammars, batch or len(grammars), model.args.vocab_size, k)


def schema_grammars(schemas):
    return [guided.json_schema(json.dumps(s)) for s in schemas]


def assert_valid(tokenizer, rows, schemas):
    for row, schema in zip(rows, schemas):
        jsonschema.validate(json.loads(tokenizer.decode(row)), schema)


def test_fifty_random_schemas_give_valid_json_on_the_builtin_model_a_schema_per_batch_row(builtin):
    model, tok = builtin
    for i in range(0, 50, 25):
        schemas = SCHEMAS[i : i + 25]
        result = generate(model, [tok.encode("data = ")] * 25, 256, tok.eos_ids,
                          guide=guide(model, tok, schema_grammars(schemas)), temperature=0)
        assert result.incomplete == []
        assert_valid(tok, result.rows, schemas)


@needs_smollm2
def test_twenty_five_random_schemas_give_valid_json_on_smollm2(smollm2):
    # half of the fifty the built-in model gets: one batch, each row under its own schema
    model, tok = load_model(smollm2, torch.device("cpu"), torch.bfloat16), load_tokenizer(smollm2, read_config(smollm2))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Reply with a JSON object."}]),
                        bos=False, specials=True)
    torch.manual_seed(0)
    schemas = SCHEMAS[25:50]
    result = generate(model, [prompt] * 25, 256, tok.eos_ids, guide=guide(model, tok, schema_grammars(schemas)),
                      temperature=0.7)
    assert result.incomplete == []
    assert_valid(tok, result.rows, schemas)


def test_sampled_rows_match_a_date_regex_in_full(builtin):
    model, tok = builtin
    torch.manual_seed(0)
    result = generate(model, [tok.encode("date: ")] * 8, 40, tok.eos_ids,
                      guide=guide(model, tok, [guided.regex(r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d")], 8), temperature=1.0)
    texts = [tok.decode(r) for r in result.rows]
    assert all(re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d", t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled, not one answer forced


def test_a_lark_grammar_gives_arithmetic_expressions(builtin, tmp_path):
    model, tok = builtin
    (tmp_path / "arithmetic.lark").write_text(ARITHMETIC)
    torch.manual_seed(0)
    result = generate(model, [tok.encode("x = ")] * 6, 60, tok.eos_ids,
                      guide=guide(model, tok, [guided.lark(str(tmp_path / "arithmetic.lark"))], 6), temperature=0.8)
    assert result.incomplete == []
    for row in result.rows:
        text = re.sub(r"\b0+(\d)", r"\1", tok.decode(row))  # Python reads 072 as no number; the grammar allows it
        tree = ast.parse(text, mode="eval")
        assert {type(n).__name__ for n in ast.walk(tree)} <= {"Expression", "BinOp", "Constant", "Add", "Sub", "Mult",
                                                             "Div"}, text


def test_a_complete_grammar_ends_the_row_without_eos(builtin):
    model, tok = builtin
    result = generate(model, [tok.encode("Answer: ")], 50, None, guide=guide(model, tok, [guided.regex("(yes|no)")]),
                      temperature=0)
    assert tok.decode(result.rows[0]) in ("yes", "no") and result.incomplete == []


def test_forced_tokens_are_fed_in_one_pass_and_counted(builtin):
    model, tok = builtin
    result = generate(model, [tok.encode("person = ")], 120, tok.eos_ids,
                      guide=guide(model, tok, schema_grammars([PERSON])), temperature=0)
    assert_valid(tok, result.rows, [PERSON])
    assert result.forced >= len(tok.encode('{"name": "', bos=False)) - 1  # the key names at least
    assert result.forwards + 1 < len(result.rows[0])  # fewer passes than tokens: forced ones came in batches
    assert result.metrics(1)["forced_tokens"] == result.forced


@pytest.mark.parametrize("option", [["--json"], ["--regex", "a+"], ["--json_schema", "{}"]])
def test_an_llguidance_older_than_1_9_is_named_in_one_line(monkeypatch, capsys, option):
    real = guided.importlib.metadata.version
    monkeypatch.setattr(guided.importlib.metadata, "version", lambda name: "1.6.1" if name == "llguidance" else real(name))
    import cli
    import generate
    with pytest.raises(SystemExit) as e:
        cli.run_main(generate.main, [*option, "--max_new_tokens", "4"])
    assert e.value.code == 2
    [line] = errors_of(capsys.readouterr().err)  # argparse names the option first: "error: argument --regex: ..."
    assert line.startswith("error: ") and line.endswith("guided generation needs llguidance 1.9 or newer; this is 1.6.1")

def test_masked_sampling_draws_only_allowed_tokens_in_the_models_proportions():
    torch.manual_seed(0)
    V, N = 50, 40_000
    logits = torch.randn(1, V) * 2
    allowed = torch.rand(V) < 0.4
    bits = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for t in allowed.nonzero()[:, 0].tolist():
        bits[0, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)  # bit 31 wraps to the sign, as in int32
    draws = torch.tensor(pick(logits.expand(N, V), [Sampling(temperature=1.0, top_k=None)] * N, torch.rand(N).tolist(),
                              allowed_tokens(bits.expand(N, -1), V)))
    freq = torch.bincount(draws, minlength=V).float() / N
    expected = torch.where(allowed, logits[0], -float("inf")).softmax(-1)
    assert freq[~allowed].sum() == 0
    assert (freq - expected).abs().max() < 0.015
    assert pick(logits, [Sampling(temperature=0)], [0.0], allowed_tokens(bits, V))[0] == expected.argmax().item()


@pytest.mark.parametrize("proposer", ["prompt_lookup", "draft"])
def test_speculative_guided_gives_the_plain_guided_greedy_output(builtin_f32, proposer):
    model, draft, tok = builtin_f32
    prompt, schemas = tok.encode("person = "), [PERSON] + SCHEMAS[:3]
    for schema in schemas:
        plain = generate(model, [prompt], 100, tok.eos_ids, guide=guide(model, tok, schema_grammars([schema])),
                         temperature=0)
        spec = speculative_generate(model, prompt, 100, 4, draft=draft if proposer == "draft" else None,
                                    ngram=2 if proposer == "prompt_lookup" else None, adaptive=True,
                                    eos_ids=tok.eos_ids, guide=guide(model, tok, schema_grammars([schema]), k=4),
                                    temperature=0)
        assert spec.rows == plain.rows and spec.forced > 0
        assert_valid(tok, spec.rows, [schema])


def test_speculative_guided_sampling_keeps_to_the_grammar(builtin_f32):
    model, draft, tok = builtin_f32
    torch.manual_seed(0)
    kept = 0
    for schema in SCHEMAS[:4]:
        result = speculative_generate(model, tok.encode("data = "), 256, 4, draft=draft, eos_ids=tok.eos_ids,
                                      guide=guide(model, tok, schema_grammars([schema]), k=4), temperature=0.8)
        assert result.incomplete == []
        assert_valid(tok, result.rows, [schema])
        kept += sum(j * c for j, c in enumerate(result.accept_histogram))
    assert kept > 0  # the draft's masked proposals were taken


def test_compiled_guided_decoding_matches_eager_and_compiles_once(builtin_f32):
    model, _, tok = builtin_f32
    steps = Backend(model, compile=True)
    model.setup_caches(1, 256)  # large enough for every call below: a new cache would be a new graph input
    g = guide(model, tok, schema_grammars([PERSON]))  # batch 1: the steps see one token and several (fast-forward)
    eager = generate(model, [tok.encode("person = ")], 100, tok.eos_ids, guide=g, temperature=0)
    compiled = generate(model, [tok.encode("person = ")], 100, tok.eos_ids, guide=g, backend=steps, temperature=0)
    assert compiled.rows == eager.rows and compiled.forced > 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    other = guide(model, tok, schema_grammars(SCHEMAS[1:2]))
    again = generate(model, [tok.encode("data = ")], 100, tok.eos_ids, guide=other, backend=steps, temperature=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # new prompt, schema, masks: no compile
    assert_valid(tok, again.rows, SCHEMAS[1:2])


def test_int8_and_int4_models_keep_to_the_schema(tmp_path):
    tok = load_tokenizer(BUILTIN, read_config(BUILTIN))
    for mode in ("int8", "int4"):
        run("scripts/quantize_checkpoint.py", "--checkpoint_path", BUILTIN, "--mode", mode,
            "--out_dir", tmp_path / mode)
        model = load_model(tmp_path / mode, torch.device("cpu"), torch.bfloat16)
        result = generate(model, [tok.encode("data = ")] * 5, 256, tok.eos_ids,
                          guide=guide(model, tok, schema_grammars(SCHEMAS[:5])), temperature=0)
        assert result.incomplete == []
        assert_valid(tok, result.rows, SCHEMAS[:5])


def test_generate_cli_prints_json_of_the_schema_and_the_forced_count(tmp_path):
    (tmp_path / "person.json").write_text(json.dumps(PERSON))
    r = run("generate.py", "--prompt", "person = ", "--json_schema", tmp_path / "person.json", "--max_new_tokens", 120,
            "--device", "cpu")
    text = r.stdout.splitlines()[1]
    jsonschema.validate(json.loads(text[len("person = "):]), PERSON)
    assert re.search(r"Guided: \d+ new tokens forced by the grammar", r.stdout)


@needs_smollm2
def test_smollm2_chat_gives_a_person_as_json(smollm2, tmp_path):
    (tmp_path / "person.json").write_text(json.dumps(PERSON))
    for seed in (1, 2):
        r = run("generate.py", "--checkpoint_path", smollm2, "--chat", "--prompt", "Give me a person as JSON",
                "--json_schema", tmp_path / "person.json", "--seed", seed, "--device", "cpu")
        jsonschema.validate(json.loads(r.stdout.splitlines()[1]), PERSON)


@needs_smollm2
def test_chat_py_replies_match_the_schema_turn_after_turn(smollm2):
    r = run("chat.py", "--checkpoint_path", smollm2, "--json_schema", json.dumps(PERSON), "--device", "cpu",
            "--max_new_tokens", 120, stdin="Give me a person as JSON.\nAnother one, older.\n")
    replies = r.stdout.strip().splitlines()
    assert len(replies) == 2
    for reply in replies:
        jsonschema.validate(json.loads(reply), PERSON)


@pytest.mark.parametrize("proposer", ["prompt_lookup", "draft"])
def test_sampled_speculative_guided_decoding_has_the_masked_target_distribution(checkpoint, sp_model_path, tmp_path,
                                                                               proposer):
    """Two sampled tokens under a regex, 2000 times, against the exact joint distribution of the target's
    probabilities renormalized over the tokens the grammar allows at each step."""
    from conftest import convert, save_hf_llama
    from test_speculative import chi_square_p_value
    target = load_model(checkpoint, torch.device("cpu"), torch.float32, "off")
    save_hf_llama(tmp_path / "hf", sp_model_path, seed=1)  # a second random model: the draft
    draft = load_model(convert(tmp_path / "hf", tmp_path / "draft"), torch.device("cpu"), torch.float32, "off")
    tok = load_tokenizer(checkpoint, read_config(checkpoint))
    g = guide(target, tok, [guided.regex("[ab]{3,6}")], k=2)

    def allowed_after(tokens):  # the grammar's allowed tokens after these, and whether it is complete there
        g.reset()
        for t in tokens:
            g.consume(0, t)
        bits = g.fill()[0]
        return [t for t in range(target.args.vocab_size) if guided.allows(bits, t)], g.complete(0)

    first, _ = allowed_after([])
    prompt = [tok.bos_id] + first * 3  # every allowed token is followed by one: prompt lookup always proposes
    joint = {}
    with torch.no_grad():
        def masked_probs(tokens, allowed):
            logits = target(torch.tensor([tokens]))[0, -1]
            return torch.full_like(logits, -float("inf")).index_copy(0, torch.tensor(allowed), logits[allowed]) \
                .softmax(-1)
        p1 = masked_probs(prompt, first)
        for x1 in first:
            second, complete = allowed_after([x1])
            if complete:
                joint[(x1, None)] = p1[x1].item()
                continue
            p2 = masked_probs(prompt + [x1], second)
            joint.update({(x1, x2): (p1[x1] * p2[x2]).item() for x2 in second})
    cells = list(joint)
    counts, kept = torch.zeros(len(cells)), 0
    torch.manual_seed(0)
    for _ in range(2000):
        r = speculative_generate(target, prompt, 2, 2, draft=draft if proposer == "draft" else None,
                                 ngram=1 if proposer == "prompt_lookup" else None, guide=g, temperature=1.0)
        row = r.rows[0]
        counts[cells.index((row[0], row[1] if len(row) > 1 else None))] += 1
        kept += sum(j * c for j, c in enumerate(r.accept_histogram))
    assert kept > 100  # proposals were verified and taken, not only drawn afresh
    assert chi_square_p_value(counts, torch.tensor([joint[c] for c in cells])) > 1e-3
