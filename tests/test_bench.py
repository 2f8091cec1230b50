"""The benchmarks' quick modes run end to end and write their JSON (their figures are checked by reading them, not
here: a timed test is not a benchmark)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_speculative_quick_runs_every_row_and_writes_json(tmp_path):
    out = tmp_path / "spec.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench_speculative.py"), "--quick", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    sets = json.loads(out.read_text())["sets"]
    assert sets and all({"plain", "prompt lookup, n=3, K<=8"} <= set(rows) for rows in sets.values())
    assert all(row["tokens_per_sec"] > 0 for rows in sets.values() for row in rows.values())
