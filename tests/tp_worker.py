"""Run under torchrun by test_tp.py: load a checkpoint sharded over the ranks, then save (rank 0) the logits of
a fixed prompt and a greedy continuation, for comparison with a single process. An optional third argument names
the device (cpu, with gloo, by default; cuda, with NCCL)."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tp  # noqa: E402
from generate import generate  # noqa: E402

ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
rank, world, device = tp.init_distributed(torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu"))
model = tp.load_sharded(ckpt, rank, world, device, torch.float32)
prompt = [1, 17, 42, 99, 7, 120, 5]
model.setup_caches(1, 64)
with torch.no_grad():
    logits = model(torch.tensor([prompt], device=device), model.context(torch.arange(len(prompt), device=device)))[0]  # [S, V]
tokens = generate(model, [prompt], 20, temperature=0).rows[0]
if rank == 0:
    save_file({"logits": logits.cpu().contiguous()}, out / "logits.safetensors")
    (out / "tokens.json").write_text(json.dumps(tokens))
tp.finish()
