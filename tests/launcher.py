"""command(script, *args): the project's commands run as `python script args` would, without Python's and torch's
start-up each time.

A command started from nothing spends seconds importing torch and the project before it reads its arguments, and
the tests run a few hundred. So the first command starts this file as a server, which imports all
that once, then forks a child per command: the child runs the script as __main__ with the command's argv, working
folder and standard streams, and exits as the interpreter would, with the status of SystemExit, or 1 and the
traceback on stderr. Requests go one JSON line at a time to the server's stdin ({"argv", "cwd", "stdin", "stdout",
"stderr", "timeout"}: file names and seconds); each answer is a line on its stdout, the exit status or "timeout".
Commands that need their own environment or signals still start a process of their own."""
import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["torch", "generate", "chat", "eval", "speculative", "tp", "convert_hf_checkpoint", "convert_gguf",
           "quantize_checkpoint", "train_tiny", "bench", "bench_quantize", "bench_speculative"]


def preload():  # before any thread starts: a child forked from a process with an OpenMP pool cannot use one
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a command that needs it fails in its child, as it would alone, with the real error
    del sys.path[:2]  # each child puts its script's folder first, as the interpreter does


def exit_status(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def run(request: dict, *server_files):  # in the child; never returns
    for f in server_files:
        f.close()
    os.chdir(request["cwd"])
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", written), (2, "stderr", written)):
        f = os.open(request[name], flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin, sys.stdout = open(0, closefd=False), open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = request["argv"]
    sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
    status = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        status = exit_status(e)
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def wait(pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status))
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.01)


def main():
    preload()
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run(request, requests, answers)
        answers.write(f"{wait(pid, request['timeout'])}\n")
        answers.flush()


if __name__ == "__main__":
    main()


# ---- the tests' side -------------------------------------------------------------------------------------------------

_server, _files, _count = None, None, 0


def command(script, *args, stdin: bytes = None, timeout: float = 300, text: bool = False) -> subprocess.CompletedProcess:
    """`python script args` from the repository's root (script relative to it, or absolute), its output captured."""
    global _server, _files, _count
    if _server is None:
        _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _files = tempfile.TemporaryDirectory(prefix="launcher-")
        atexit.register(lambda: (_server.stdin.close(), _server.wait(timeout=60), _files.cleanup()))
    _count += 1
    files = {name: Path(_files.name) / f"{_count}.{name}" for name in ("stdin", "stdout", "stderr")}
    files["stdin"].write_bytes(stdin or b"")
    argv = [str(ROOT / script), *(os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args)]
    _server.stdin.write(json.dumps({"argv": argv, "cwd": str(ROOT), "timeout": timeout,
                                    **{k: str(v) for k, v in files.items()}}) + "\n")
    _server.stdin.flush()
    status = _server.stdout.readline().strip()
    if not status:
        raise RuntimeError(f"tests/launcher.py exited (status {_server.poll()}); its error is above")
    out, err = (files[f].read_bytes() for f in ("stdout", "stderr"))
    for f in files.values():
        f.unlink()
    if text:  # as subprocess's text mode reads them: universal newlines
        out, err = (b.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n") for b in (out, err))
    if status == "timeout":
        raise subprocess.TimeoutExpired(argv, timeout, out, err)
    return subprocess.CompletedProcess(argv, int(status), out, err)
