"""What every command shares. Bad input ends in one line on stderr and exit status 2, Ctrl-C in one line and
status 130; options are checked before any work starts; an output file replaces only an earlier output of the
same kind; the CPU thread count is set once, with a warning when other work already keeps the cores busy."""
import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

BAD_INPUT, INTERRUPTED = 2, 130
OLDEST_TORCH = "2.11"  # the oldest torch the tests pass on (2.11.0, 2.13.0); 2.5 lacks options and ops used here


def fail(msg: str):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT)


if torch.__version__ < OLDEST_TORCH:  # checked on import, before any module sets an option this torch lacks
    fail(f"torch {OLDEST_TORCH} or newer is needed; this is torch {torch.__version__}")


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def run_main(main: Callable, *args):
    """Call main(*args) the way every entry point does: bad input is one line and status 2, Ctrl-C is one line
    and status 130; what was printed before either stays."""
    try:
        main(*args)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    except (ValueError, OSError) as e:  # UnicodeError, json errors and file errors are among these
        fail(first_line(e))
    except (MemoryError, torch.OutOfMemoryError):
        fail("out of memory: lower --batch_size or --max_seq_length, or use a quantized checkpoint")


def summary(doc: str) -> str:
    """A module docstring's first paragraph as one line: the description --help prints."""
    return " ".join(doc.split("\n\n")[0].split())


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.error = lambda msg: fail(msg)  # one line, not argparse's usage block
    return p


def require(checks: list[tuple[bool, str]]):
    """Raise ValueError with the message of the first check that fails."""
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


# ---- files ---------------------------------------------------------------------------------------------------------

def check_output_file(path: Optional[Path], flag: str, marker: str):
    """Raise unless `path` can be written now: its folder exists and is writable, and the path is new or holds an
    earlier output of this flag (`marker` appears in its first megabyte). Called before any long work."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")
    if path.exists():
        with open(path, "rb") as f:
            if marker.encode() not in f.read(1 << 20):
                raise ValueError(f"{flag} {path} exists and is not an earlier output of {flag}; "
                                 f"choose another path")


def write_file(path: Path, write: Callable[[Path], None]):
    """Write beside `path`, then rename: a crash or Ctrl-C leaves the old file or none, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_text_file(path: Path, what: str, available: Optional[int] = None) -> Path:
    """Raise unless `path` is a UTF-8 text file that fits in memory several times over (it is read whole, then
    tokenized: the token ids take several times the text's size)."""
    if not path.is_file():
        raise ValueError(f"{what} {path} not found")
    size = path.stat().st_size
    available = available if available is not None else available_memory()
    if size * 8 > available:
        raise ValueError(f"{what} {path} is {size / 1e9:.1f} GB; reading and tokenizing it needs about "
                         f"{size * 8 / 1e9:.1f} GB, and {available / 1e9:.1f} GB is available")
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    try:
        (head[: -4] if len(head) == 1 << 16 else head).decode("utf-8")  # a cut may fall inside a character
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None
    if b"\0" in head:
        raise ValueError(f"{what} {path} is binary, not text")
    return path


def available_memory(device: Optional[torch.device] = None) -> int:
    """Bytes that can be allocated now on `device` (the CPU by default)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # no /proc (macOS): all of RAM


# ---- threads -------------------------------------------------------------------------------------------------------

def physical_cores() -> int:
    """Cores this process may run on, not counting SMT siblings: a second thread per core adds no bandwidth."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        cores, block = set(), {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            if ":" in line:
                key, value = (s.strip() for s in line.split(":", 1))
                block[key] = value
            elif block:
                if int(block.get("processor", -1)) in cpus:
                    cores.add((block.get("physical id"), block.get("core id", block.get("processor"))))
                block = {}
        return max(1, min(len(cores), len(cpus)))
    except (OSError, ValueError):
        return max(1, len(cpus))


def busy_threads(samples: int = 5) -> int:
    """Threads of other processes running right now: the fewest seen in a few looks at /proc/stat, less this one."""
    try:
        seen = []
        for _ in range(samples):
            stat = Path("/proc/stat").read_text()
            seen.append(int(next(l.split()[1] for l in stat.splitlines() if l.startswith("procs_running"))) - 1)
            time.sleep(0.02)
        return max(0, min(seen))
    except (OSError, StopIteration, ValueError):
        return 0


def set_threads(threads: Optional[int], share: int = 1, decode: bool = True) -> int:
    """Use `threads` CPU threads (default: the physical cores, split among `share` processes on one machine).
    Decode runs one parallel region per layer, and each waits for its slowest thread: a thread that has to share
    its core with other work stalls all of them, so before decoding say so once, with the fix."""
    threads = threads or max(1, physical_cores() // share)
    torch.set_num_threads(threads)
    if not decode:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    others = max(0, busy_threads() - (share - 1))  # less the other ranks of a tensor-parallel run, loading too
    if others and threads * share + others > cores:
        print(f"warning: {others} thread(s) of other programs are running on this machine's {cores} CPUs; decode "
              f"with {threads} threads can be many times slower while they do. Stop them, or pass --threads "
              f"{max(1, (cores - others) // share)}", file=sys.stderr, flush=True)
    return threads
