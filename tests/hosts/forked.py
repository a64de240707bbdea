"""``python tests/hosts/forked.py SCRIPT ARGS...`` (or ``-m MODULE ARGS...``): run SCRIPT as ``python SCRIPT`` would,
forked from the test suite's zygote (tests/zygote.py) so that it skips ~5 s of importing torch and Lightning.

This process stays the one the test (or `nodeox launch`, or torchrun) started: it hands the zygote its argv,
environment, cwd, open-file limits, CPU affinity and stdin/stdout/stderr, forwards the signals it gets to the child
and exits as the child did (the same code; killed by the same signal). If it is killed (-9), the zygote kills the
child. Without ``NODEOX_TEST_ZYGOTE`` (the zygote's socket), with ``NODEOX_TEST_NO_ZYGOTE=1``, or when the zygote
is unreachable or refuses, it runs ``python SCRIPT ARGS...`` in its place (exec). Standard library only.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM,
             signal.SIGCONT, signal.SIGWINCH)


def run_itself(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def receive(conn: socket.socket) -> int:
    """The next signed 8-byte number on ``conn``; raises ConnectionError at its end."""
    data = b""
    while len(data) < 8:
        more = conn.recv(8 - len(data))
        if not more:
            raise ConnectionError("the zygote closed the connection")
        data += more
    return struct.unpack("!q", data)[0]


def main(argv: list[str]) -> None:
    path = os.environ.get("NODEOX_TEST_ZYGOTE")
    if not argv or not path or os.environ.get("NODEOX_TEST_NO_ZYGOTE") == "1":
        run_itself(argv)
    ignored = [s for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")}
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "ignored": ignored,
                          "limits": limits, "affinity": sorted(os.sched_getaffinity(0))}).encode()
    pid = None
    pending: list[int] = []

    def forward(signum, _frame) -> None:
        if pid is None:
            pending.append(signum)
        else:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for s in FORWARDED:
        if s not in ignored:
            signal.signal(s, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        socket.send_fds(conn, [struct.pack("!Q", len(request)) + request], [0, 1, 2])
        answer = receive(conn)
    except OSError:  # no zygote there (any more)
        conn.close()
        for s in FORWARDED:
            if s not in ignored:
                signal.signal(s, signal.SIG_DFL)
        if pending:
            os.kill(os.getpid(), pending[0])
        run_itself(argv)
    if answer < 0:  # refused: the environment would not start the same way in the zygote
        conn.close()
        for s in FORWARDED:
            if s not in ignored:
                signal.signal(s, signal.SIG_DFL)
        run_itself(argv)
    pid = answer
    for s in pending:
        forward(s, None)
    try:
        status = receive(conn)
    except ConnectionError:  # the zygote is gone (its session ended): so is the child
        status = signal.SIGKILL
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
