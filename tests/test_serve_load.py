"""serve.py under load, faults and hostile requests, over loopback: rounds of a few hundred requests from concurrent
clients, some hanging up mid-stream, some malformed or oversized, bursts past the waiting queue. After each round
the server must answer correctly, hold no KV block, have given no 500, have mixed no request's tokens into another's,
and not have grown in memory from round to round."""
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_serve import BUILTIN, serving

pytest.importorskip("openai", reason="needs: pip install openai (the tests' client)")

PROMPTS = [f"def f{i}(x):\n    return x + {i}" for i in range(24)]  # each its own greedy answer


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = [b"{bad", b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "max_tokens": 1e9}',
           json.dumps({"prompt": "x", "model": "other"}).encode(), json.dumps({"prompt": [-1]}).encode(),
           json.dumps({"prompt": "x", "max_tokens": 10**12}).encode(), json.dumps({"prompt": {"a": 1}}).encode(),
           b"[" * 50000, json.dumps({"prompt": "x" * (3 << 20)}).encode(),
           json.dumps({"prompt": "x", "max_tokens": 5, "response_format": {
               "type": "json_schema", "json_schema": {"schema": nested(400)}}}).encode()]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_rounds_of_load_faults_and_hostile_requests_leave_the_server_whole(tmp_path):
    with serving(BUILTIN, tmp_path, "--max_rows", 8, "--max_waiting", 12) as s:
        def greedy(prompt: str, **extra) -> tuple[int, object]:
            return s.http("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, **extra})

        alone = {p: greedy(p)[1]["choices"][0]["text"] for p in PROMPTS}  # one at a time: the reference
        statuses, wrong, hung_up, rng = [], [], [], random.Random(0)

        def one(i: int):
            kind = rng.random()
            p = PROMPTS[i % len(PROMPTS)]
            if i % 50 == 49:  # a burst of 24 at once, past the 12 waiting places the others leave
                with ThreadPoolExecutor(24) as burst:
                    statuses.extend(burst.map(lambda q: greedy(q)[0], PROMPTS))
            elif kind < 0.45:  # a streamed answer, which must be this prompt's own
                status, events = s.events("/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})
                text = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]" and e.get("choices"))
                wrong.extend([(p, text)] if status == 200 and text != alone[p] else [])
                statuses.append(status)
            elif kind < 0.6:  # hangs up after two events, 198 tokens before its end
                status, _ = s.events("/v1/completions", {"prompt": p, "max_tokens": 200, "temperature": 0,
                                                         "ignore_eos": True}, stop_after=2)
                hung_up.append(status == 200)
            elif kind < 0.8:
                statuses.append(s.http("POST", "/v1/completions", HOSTILE[i % len(HOSTILE)])[0])
            else:  # whole answers, also its own (or 429 when the queue is full)
                status, answer = greedy(p)
                statuses.append(status)
                if status == 200 and answer["choices"][0]["text"] != alone[p]:
                    wrong.append((p, answer["choices"][0]["text"]))

        sizes = []
        for round_ in range(3):
            with ThreadPoolExecutor(12) as pool:  # 12 clients at once
                list(pool.map(one, range(100 * round_, 100 * round_ + 100)))
            for _ in range(300):  # the hung-up requests' cancellations land within a step or two
                if not (s.metric("requests_running") or s.metric("requests_waiting")):
                    break
                time.sleep(0.1)
            assert s.metric("kv_blocks_in_use") == 0 and s.metric("requests_running") == 0  # every block back
            assert greedy(PROMPTS[0])[1]["choices"][0]["text"] == alone[PROMPTS[0]]  # still answers right
            sizes.append(rss_kb(s.proc.pid))
        assert not wrong, wrong[:3]
        assert 500 not in statuses and statuses.count(200) > 100 and {400, 404, 413} <= set(statuses)
        assert 429 in statuses  # the bursts went past the queue
        assert sizes[2] - sizes[1] < 30_000, sizes  # kB: no growth from round to round once warm
        assert s.metric('requests_finished_total{reason="cancelled"}') >= sum(hung_up) > 10  # hung up: cancelled
