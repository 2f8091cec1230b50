"""Tensor parallelism (Megatron-style) over torch.distributed, launched with torchrun: NCCL with one GPU per rank,
or gloo with CPU processes.

Each rank holds 1/W of every transformer layer: wqkv, w1 and w3 are split by output rows (column-parallel; q, k
and v each by heads, and wqkv's bias bqkv alike), wo and w2 by input columns (row-parallel), and the partial
outputs of wo and w2 are summed by an all-reduce. A layer thus needs two all-reduces of [B, S, dim] and reads only
its own 1/W of the weights. The embedding and the output head are replicated: every rank computes identical logits
and, seeded alike, samples the same token, so no rank waits for another to broadcast it.

The split is done on the checkpoint's tensors before they reach the device, so a rank never holds the whole
model; the local model is built from `local_args`, whose head counts and feed-forward width are 1/W of the full
ones, so its attention, shapes and KV cache (n_kv_head / W heads) need no special case.

    python tp.py --ranks 2 [generate.py's and speculative.py's flags]    (checks the split, then runs torchrun:)
    torchrun --standalone --nproc_per_node=2 tp.py [generate.py's and speculative.py's flags]"""
import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line and status 130, as cli.run_main says later
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted", file=sys.stderr), os._exit(130)))

import dataclasses  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch import Tensor  # noqa: E402

import checkpoint  # noqa: E402
import cli  # noqa: E402
import generate  # noqa: E402
import speculative  # noqa: E402

# a dead rank leaves the others blocked in a collective; this bounds the wait (torchrun also stops them at once)
TIMEOUT = timedelta(seconds=120)
COLUMN = ("attention.wqkv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def init_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device) as torchrun set them. Only rank 0 prints."""
    if "LOCAL_RANK" not in os.environ:
        raise ValueError("tp.py runs under torchrun: torchrun --standalone --nproc_per_node=N tp.py ...")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} needs GPU {local}, but this machine has {torch.cuda.device_count()}: "
                             f"run at most that many ranks per machine, or pass --device cpu")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    if rank > 0:
        sys.stdout = open(os.devnull, "w")
    return rank, world, device


def finish():
    """Leave together, and without tearing gloo down: a rank whose peer closed its connections first could abort
    in the teardown ("terminate called without an active exception"), after all
    its work was done. The barrier ensures every rank has finished; the process then ends at once."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def local_args(args, world: int, groupsize: Optional[int] = None):
    """The shapes one of `world` ranks holds; raises, on every rank alike, when the model does not split evenly."""
    for name in ("n_head", "n_kv_head", "intermediate_size"):
        if getattr(args, name) % world:
            raise Refused(f"{name} {getattr(args, name)} is not divisible by the world size {world}")
    if groupsize:  # a row-parallel shard must hold whole int4 groups
        for name, k in (("n_head * head_dim", args.n_head * args.head_dim), ("intermediate_size", args.intermediate_size)):
            if (k // world) % groupsize:
                raise Refused(f"{name} / world size = {k // world} is not a multiple of the int4 group size "
                                 f"{groupsize}; quantize with a smaller --groupsize")
    return dataclasses.replace(args, n_head=args.n_head // world, n_kv_head=args.n_kv_head // world,
                               intermediate_size=args.intermediate_size // world)


def shard_state(state: dict, args, rank: int, world: int, device) -> dict:
    """This rank's slice of every tensor, moved to `device`. Float, int8 and int4 layouts all keep output rows on
    dim 0 and input columns (or column groups, or packed column pairs) on dim 1, so one rule serves all three.
    Per-output-channel int8 scales of a row-parallel layer apply after the sum, so they are replicated."""
    hd = args.head_dim
    qkv = [args.n_head * hd, args.n_kv_head * hd, args.n_kv_head * hd]
    out = {}
    for key, t in state.items():
        layer = key.rsplit(".", 1)[0]
        if layer.endswith(COLUMN[0]) or key.endswith(".bqkv"):  # q, k and v are stacked: this rank's heads of each
            t = torch.cat([part.chunk(world, 0)[rank] for part in t.split(qkv, 0)])
        elif layer.endswith(COLUMN[1:]):
            t = t.chunk(world, 0)[rank]
        elif layer.endswith(ROW) and t.dim() == 2:
            t = t.chunk(world, 1)[rank]
        out[key] = t.contiguous().to(device)  # contiguous: a copy of the slice, not a view pinning the whole file
    return out


class AllReduce(nn.Module):
    """A row-parallel layer whose partial outputs are summed over the ranks. Functional collectives are ordinary
    ops to torch.compile, so the compiled decode step stays one graph."""
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return funcol.all_reduce(self.layer(x), "sum", dist.group.WORLD)


def install(model: nn.Module) -> nn.Module:
    """Wrap the row-parallel layers (attention.wo, feed_forward.w2) so that their outputs are summed."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if f"{name}.{child_name}".endswith(ROW):
                setattr(module, child_name, AllReduce(child))
    return model


def load_sharded(checkpoint_path, rank: int, world: int, device, dtype, cpu_kernels: str = "auto") -> nn.Module:
    """This rank's slice of the checkpoint's model: read on the CPU (memory-mapped), sliced, and only the slice
    moved to `device`. Raises, on every rank alike, when the model does not split evenly."""
    ckpt_dir, weights = checkpoint.checkpoint_files(checkpoint_path)
    args, quantization = checkpoint.read_config(ckpt_dir), checkpoint.read_quantization(weights)
    local = local_args(args, world, quantization[1] if quantization and quantization[0] == "int4" else None)
    args, quantization, state = checkpoint.read_checkpoint(checkpoint_path, "cpu", dtype)
    state = shard_state(state, args, rank, world, device)
    return install(checkpoint.build(local, quantization, state, device, dtype, cpu_kernels))


@dataclasses.dataclass
class Parallel:
    """What generate.run needs to know of the ranks: this rank, its device, how to load its slice, and how to
    combine host figures over the ranks."""
    rank: int
    world: int
    device: torch.device
    load_model: Callable
    sum: Callable = None
    gather: Callable = None


def world_sum(values: list[float], device, mean: bool = False) -> list[float]:
    """Sum (or average) host figures over the ranks: aggregate bandwidth, and the adaptive draft rule's timings,
    which must agree on every rank or the ranks would draft different lengths; identity alone."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size() if mean else t).tolist()


def world_gather(value: float) -> list[float]:  # one figure per rank, e.g. peak memory
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main(argv=None):
    args = speculative.parse_args(argv)
    rank, world, device = init_distributed(generate.resolve_device(args.device))
    load = lambda path, device, dtype, kernels: load_sharded(path, rank, world, device, dtype, kernels)  # noqa: E731
    sums = lambda values, mean=False: world_sum(values, device, mean)  # noqa: E731
    speculative.run_parsed(args, Parallel(rank, world, device, load, sums, world_gather))
    finish()


class Refused(ValueError):
    """Bad input that every rank finds alike (its options, the model's split): rank 0 alone says so."""


def main_of_rank(argv=None):
    try:
        main(argv)
    except ValueError as e:
        if int(os.environ.get("RANK", 0)) > 0 and isinstance(e, Refused):
            os._exit(cli.BAD_INPUT)
        raise
    except RuntimeError as e:  # a collective fails when another rank dies or stops answering
        if not dist.is_initialized():
            raise
        # one line, then out at once, as finish() leaves: tearing gloo down with a peer gone could abort after it
        # ("terminate called without an active exception")
        sys.stdout.flush()
        print(f"error: rank {dist.get_rank()} lost contact with the other ranks: {cli.first_line(e)}",
              file=sys.stderr, flush=True)
        os._exit(cli.BAD_INPUT)


def launch(argv=None):
    """python tp.py --ranks N [flags]: the checks every rank would make alike, made once here, where a refusal is
    one line (under torchrun it would come with torchrun's report of the failed ranks), then torchrun."""
    argv = sys.argv[1:] if argv is None else argv
    at = argv.index("--ranks")
    ranks, rest = cli.positive_int(argv[at + 1]) if at + 1 < len(argv) else 0, argv[:at] + argv[at + 2:]
    if not ranks:
        raise ValueError("--ranks needs a number of processes")
    args = speculative.parser().parse_args(rest)  # the options alone: a prompt on standard input stays unread
    ckpt_dir, weights = checkpoint.checkpoint_files(args.checkpoint_path)
    quantization = checkpoint.read_quantization(weights)
    local_args(checkpoint.read_config(ckpt_dir), ranks, quantization[1] if quantization and quantization[0] == "int4"
               else None)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={ranks}", __file__, *rest])


if __name__ == "__main__":
    cli.run_main(launch if "--ranks" in sys.argv and "LOCAL_RANK" not in os.environ else main_of_rank)
