"""A fork server for the test suite's host and coordinator processes (test-only; it exists for the suite's time).

Every process a test starts that imports torch and Lightning spends ~5 s of CPU importing them before it does
anything; on a small machine, over a hundred tests, that is minutes of the suite. This server imports them once
(torch, lightning.pytorch, torchmetrics, sklearn, safetensors, numpy: never lightning_nodeox, which the child
imports fresh, from its own PYTHONPATH) and forks a child per request from tests/hosts/forked.py, which stays the
test's process: it passes its argv, environment, cwd, open-file limits, CPU affinity and stdin/stdout/stderr, forwards
signals to the child and exits as the child did; when it is killed (-9) the server kills the child at once.

The child starts as ``python SCRIPT`` would: a session of its own, the forwarder's environment, cwd, streams (line
buffered or unbuffered as PYTHONUNBUFFERED says) and limits, default signal dispositions, fresh RNG seeds (Python's,
numpy's, torch's), ``torch.set_num_threads(OMP_NUM_THREADS)``, Lightning's rank-zero rank read again from the
environment; then ``runpy`` runs the script, atexit handlers run and it exits with the script's status. What cannot be
made the same: its parent is this server (it never looks), its str hash seed is this server's, and a request whose
environment differs from this server's in a variable read at start-up or at import (PYTHON*, OMP_*, TORCH_*, ...)
is refused, so that the forwarder runs the script itself.

Started once per pytest session (conftest.py, ``NODEOX_TEST_ZYGOTE`` names its socket); ``NODEOX_TEST_NO_ZYGOTE=1``
switches it off. ``python tests/zygote.py SOCKET`` serves until SIGTERM/SIGINT or until its parent exits.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import io
import json
import logging
import os
import resource
import runpy
import selectors
import signal
import site
import socket
import struct
import sys
import threading
import traceback

# read at interpreter start or at import (CUDA_*, NCCL_*, PL_*: only once a process uses them)
SENSITIVE = ("PYTHON", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "TORCH", "PYTORCH", "LD_", "MALLOC", "SKLEARN",
             "POSSIBLE_USER_WARNINGS")
MAY_DIFFER = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "OMP_NUM_THREADS",  # the child applies them
              "TORCHELASTIC_", "TORCH_NCCL_")  # torchrun's, for its workers: read when they run

started_env = dict(os.environ)  # before the imports: what a request's environment is compared with
import lightning.pytorch  # noqa: F401
import numpy
import safetensors.torch  # noqa: F401
import sklearn  # noqa: F401
import torch
import torchmetrics  # noqa: F401
import torchmetrics.utilities.prints as metrics_prints
from lightning.fabric.utilities import rank_zero

set_by_imports = {k: v for k, v in os.environ.items() if started_env.get(k) != v}  # e.g. PYTORCH_NVML_BASED_...
own_path = [p for p in sys.path[1:] if p not in started_env.get("PYTHONPATH", "").split(os.pathsep)]


def site_path(env: dict[str, str]) -> list[str]:
    """sys.path as a fresh interpreter with ``env`` has it while ``site`` runs (before the script's directory)."""
    pythonpath = [p or os.getcwd() for p in env["PYTHONPATH"].split(os.pathsep)] if env.get("PYTHONPATH") else []
    return [*pythonpath, *own_path]


def refusal(env: dict[str, str]) -> str | None:
    """Why a child with ``env`` would not start as a fresh interpreter would from here; None when it would."""
    for k in sorted(set(env) | set(started_env)):
        if k.startswith(SENSITIVE) and not k.startswith(MAY_DIFFER) and env.get(k) != started_env.get(k) and not (
                k in set_by_imports and env[k] == set_by_imports[k]):  # the test process made the same imports
            return f"{k} differs from the zygote's"
    if "sitecustomize" in sys.modules:  # it ran here; another one on the child's PYTHONPATH would run there
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", site_path(env))
        if spec is None or spec.origin != sys.modules["sitecustomize"].__file__:
            return "another sitecustomize"
    return None


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The forwarder's request and its three stdio file descriptors."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < 8:
        raise ConnectionError("short request")
    (size,) = struct.unpack("!Q", data[:8])
    data = data[8:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ConnectionError("request cut short")
        data += more
    return json.loads(data), fds


def stream(fd: int, write: bool, unbuffered: bool, line: bool, encoding: str, errors: str) -> io.TextIOWrapper:
    """sys.stdin/stdout/stderr on ``fd`` as the interpreter makes them (``-u``: no buffer under the text layer)."""
    raw = io.FileIO(fd, "w" if write else "r", closefd=False)
    if not write:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=encoding, errors=errors, line_buffering=line, write_through=unbuffered)


def logging_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return [h for logger in loggers for h in logger.handlers]


def become(request: dict, fds: list[int], close: list) -> None:
    """Turn this forked child into the process ``python SCRIPT`` would have started for the forwarder."""
    signal.set_wakeup_fd(-1)
    for s in close:
        s.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, min(os.sysconf("SC_OPEN_MAX"), 1 << 16))
    os.setsid()  # its own session: only the forwarder's signals reach it (it forwards them)
    for s in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        try:
            signal.signal(s, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets them
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in request["ignored"]:
        signal.signal(s, signal.SIG_IGN)
    for name, limits in request["limits"].items():
        try:
            resource.setrlimit(getattr(resource, name), limits)
        except (OSError, ValueError):
            pass
    os.sched_setaffinity(0, request["affinity"])  # `nodeox launch` pins each host's forwarder to its CPUs
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update({**set_by_imports, **env})
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = (env.get("PYTHONIOENCODING") or "").split(":")[0] or sys.stdout.encoding
    old = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
    sys.stdin = sys.__stdin__ = stream(0, False, False, False, encoding, "strict")
    sys.stdout = sys.__stdout__ = stream(1, True, unbuffered, os.isatty(1), encoding, "strict")
    sys.stderr = sys.__stderr__ = stream(2, True, unbuffered, True, encoding, "backslashreplace")
    for handler in logging_handlers():  # e.g. Lightning's, made at import on the zygote's stderr
        if id(getattr(handler, "stream", None)) in old:
            handler.setStream(getattr(sys, old[id(handler.stream)]))
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    torch.seed()  # a fresh interpreter's torch and numpy seeds differ per process (Python's random reseeds at fork)
    numpy.random.seed()
    rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0  # both read the rank from the environment at import
    metrics_prints.rank_zero_only.rank = int(env.get("LOCAL_RANK", 0))
    argv = request["argv"]
    sys.path[:] = site_path(env)
    sys.argv = ["-m"] if argv[0] == "-m" else list(argv)  # what a sitecustomize sees
    if "sitecustomize" not in sys.modules:  # the zygote had none: one on the child's PYTHONPATH runs, as site does
        site.execsitecustomize()
    sys.path.insert(0, os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0])))
    sys.argv = ["-m", *argv[2:]] if argv[0] == "-m" else list(argv)  # "-m" while the package imports, as python -m
    sys.orig_argv = [sys.executable, *argv]


def run(argv: list[str]) -> int:
    """Run the script (or ``-m`` module) as ``__main__``; its exit status (-N: end by signal N)."""
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return -signal.SIGINT  # the interpreter ends by SIGINT itself then
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1


def child(request: dict, fds: list[int], close: list) -> None:
    """The forked child: become the process, run the script, exit as the interpreter would. Never returns."""
    code = 1
    try:
        become(request, fds, close)
        code = run(request["argv"])
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads, then atexit
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
    except BaseException:  # noqa: BLE001 - the child must end here, never back in the server's loop
        traceback.print_exc()
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)


class Server:
    """Forks a child per forwarder's connection on ``path``; a connection's end (the forwarder was killed) kills
    its child; a child's exit status goes back on its connection. A ``gone`` request (helpers.py, after a
    forwarder ended) is answered once that forwarder's child is gone too: so a test that killed a forwarder
    knows the process is dead, as it would after killing the process itself."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the loop
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.children: dict[int, socket.socket] = {}  # pid -> its forwarder's connection
        self.of_forwarder: dict[int, int] = {}  # forwarder's pid -> its child's pid
        self.waiting: dict[int, list[socket.socket]] = {}  # child pid -> `gone` requests waiting for it

    def serve(self, stopping: list) -> None:
        parent = os.getppid()
        while not stopping and os.getppid() == parent:  # the session that started it never outlives it
            for key, _ in self.selector.select(1.0):
                if key.fileobj is self.listener:
                    self.accept()
                elif key.fileobj == self.wake_r:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                else:  # the forwarder is gone (it never sends): kill -9 reaches its child now
                    self.selector.unregister(key.fileobj)
                    try:
                        os.kill(key.data, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.reap()

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(10)
        peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        try:
            request, fds = read_request(conn)
        except (OSError, ValueError) as e:
            print(f"zygote: bad request: {e}", file=sys.stderr, flush=True)
            conn.close()
            return
        if "gone" in request:
            pid = self.of_forwarder.get(request["gone"])
            if pid in self.children:
                self.waiting.setdefault(pid, []).append(conn)
            else:
                conn.close()
            return
        why = refusal(request["env"])
        if why is not None:
            print(f"zygote: {request['argv'][:2]} runs by itself: {why}", file=sys.stderr, flush=True)
            conn.sendall(struct.pack("!q", -1) + why.encode())
            conn.close()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child(request, fds, [self.selector, self.listener, conn, *self.children.values(),
                                     *(c for w in self.waiting.values() for c in w)])
            conn.sendall(struct.pack("!q", pid))
            self.children[pid] = conn
            self.of_forwarder[peer] = pid
            self.selector.register(conn, selectors.EVENT_READ, pid)
        for fd in fds:
            os.close(fd)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid)
            try:
                conn.sendall(struct.pack("!q", status))
            except OSError:
                pass
            if conn in self.selector.get_map():
                self.selector.unregister(conn)
            conn.close()
            self.of_forwarder = {f: c for f, c in self.of_forwarder.items() if c != pid}
            for w in self.waiting.pop(pid, []):
                w.close()

    def close(self, path: str) -> None:
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.listener.close()
        os.unlink(path)


def serve(path: str) -> None:
    """Serve on ``path`` until SIGTERM/SIGINT/SIGHUP or until the parent is gone; every child left is killed."""
    stopping: list[int] = []
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda signum, _: stopping.append(signum))
    server = Server(path)
    try:
        server.serve(stopping)
    finally:
        server.close(path)


if __name__ == "__main__":
    serve(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing to finalize: tearing torch and Lightning down takes seconds
