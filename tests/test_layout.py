"""The files form one layered graph, read from their imports (nested ones too): no cycles, model.py needs only
torch and the standard library, and the kernel and quantization files need only model.py, so any loader may call
them."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")}


def imports(path: Path) -> set[str]:
    """The top-level names of everything the file imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


GRAPH = {name: imports(path) & MODULES.keys() for name, path in MODULES.items()}


def test_the_project_imports_form_no_cycle():
    def visit(name, path):
        assert name not in path, f"import cycle: {' -> '.join(path + [name])}"
        for dep in GRAPH[name]:
            visit(dep, path + [name])
    for name in GRAPH:
        visit(name, [])


def test_model_py_imports_only_torch_and_the_standard_library():
    assert imports(MODULES["model"]) - set(sys.stdlib_module_names) == {"torch"}


def test_the_layers_are_model_then_checkpoint_then_generate_then_the_entry_points():
    assert GRAPH["quantize"] <= {"model"} and GRAPH["cpu_gemv"] <= {"model"} and GRAPH["cuda_gemv"] <= {"model"}
    assert GRAPH["cpu_step"] <= {"model", "cpu_gemv"}
    assert GRAPH["tokenizer"] == set() and GRAPH["guided"] <= {"model"}
    assert GRAPH["cli"] <= {"guided", "cpu_gemv", "cuda_gemv", "sampling", "tokenizer"}  # options, kernels in a line
    assert GRAPH["checkpoint"] <= {"model", "quantize", "cpu_gemv", "cuda_gemv", "tokenizer", "cli"}
    assert GRAPH["sampling"] == set()  # the one rule every loop and the engine draw with
    assert GRAPH["backend"] <= {"sampling", "model", "paged", "cpu_gemv", "cpu_step", "cuda_gemv", "cuda_step"}
    assert GRAPH["generate"] <= {"model", "checkpoint", "tokenizer", "cli", "guided", "backend", "sampling"}
    for entry in ("trees", "eval"):
        assert "generate" in GRAPH[entry] and not GRAPH[entry] & {"tp", "speculative", "eval", "trees"} - {entry}
    assert {"generate", "trees"} <= GRAPH["speculative"] and not GRAPH["speculative"] & {"tp", "eval"}
    assert {"speculative", "generate", "checkpoint"} <= GRAPH["tp"]
    assert {"speculative", "generate", "guided"} <= GRAPH["fast_decode"]
    assert not GRAPH["fast_decode"] & {"tp", "chat", "eval"}


def test_the_paged_cache_needs_only_model_py_and_the_engine_sits_beside_the_decoding_loops():
    assert GRAPH["paged"] <= {"model"}  # its Context
    assert GRAPH["engine"] <= {"paged", "generate", "guided", "cli", "model", "cpu_gemv", "cpu_step", "cuda_gemv",
                               "cuda_step", "sampling", "backend"}
    assert GRAPH["cuda_step"] == set()  # the recorded step takes the cache and the model it is given
    assert "engine" in GRAPH["fast_decode"]
    assert not GRAPH["engine"] & {"speculative", "trees", "fast_decode", "tp", "chat"}


def test_every_file_is_within_its_line_budget():
    budgets = {"model.py": 300, "generate.py": 450}
    files = [*ROOT.glob("*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("tests/*.py")]
    over = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) >
            (budgets.get(p.name, 600) if p.parent == ROOT else 600)}
    assert not over, f"past the budget (model.py 300, generate.py 450, any other 600): {over}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_pyproject_installs_every_top_level_module_and_pins_every_package():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert sorted(project["tool"]["setuptools"]["py-modules"]) == sorted(p.stem for p in ROOT.glob("*.py"))
    wanted = project["project"]["dependencies"] + project["project"]["optional-dependencies"]["test"]
    assert all("==" in w for w in wanted), [w for w in wanted if "==" not in w]
    listed = [line for line in (ROOT / "requirements.txt").read_text().splitlines() if not line.startswith("#")]
    assert listed == ["-e ."]  # the same pins, read from pyproject.toml: one list
