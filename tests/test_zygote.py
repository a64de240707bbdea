"""The test suite's fork server (tests/zygote.py behind tests/hosts/forked.py) starts processes as ``python SCRIPT``
would: the argv, environment, cwd, limits and streams of the forwarder; its exit code or signal; signals forwarded;
kill -9 of the forwarder kills the child. Without the zygote the forwarder runs the script itself, the same way."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FORKED, Process

SCRIPT = '''import os, resource, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
Path(sys.argv[1]).write_text(str(os.getpid()))  # before its first line: a test that has read it may kill it
print(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), os.getcwd(), os.environ["ZYGOTE_TEST"])
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.environ["SITE_RAN"], flush=True)
print("to stderr", file=sys.stderr)
what = sys.argv[2]
if what == "exit":
    sys.exit(3)
if what == "raise":
    raise ValueError("boom")
if what == "signal":
    os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(60)
'''


@pytest.mark.slow
def test_a_forked_script_runs_and_ends_as_python_script_would(zygote, tmp_path) -> None:
    script, site = tmp_path / "script.py", tmp_path / "site"
    script.write_text(SCRIPT)
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, sys\nos.environ['SITE_RAN'] = repr(sys.argv)\n")
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(hard, 1024) // 2

    def start(what: str) -> tuple[Process, Path]:
        pid_file = tmp_path / f"{what}.pid"
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # the child gets the forwarder's limits
        try:
            proc = Process([sys.executable, str(FORKED), str(script), str(pid_file), what], cwd=tmp_path,
                           env=dict(os.environ, ZYGOTE_TEST=what, PYTHONPATH=pythonpath), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return proc, pid_file

    def forked(proc: Process, pid_file: Path) -> bool:
        return int(pid_file.read_text()) != proc.pid  # exec'd in place: the forwarder's own pid

    proc, pid_file = start("exit")
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (3, "to stderr\n")
    argv = [str(script), str(pid_file), "exit"]
    assert out.splitlines() == [f"{argv} True {tmp_path} exit", f"{low} {argv}"]  # sitecustomize ran, seeing argv
    assert forked(proc, pid_file) is (zygote is not None)
    proc, pid_file = start("raise")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err.endswith("ValueError: boom\n") and "Traceback" in err
    proc, _ = start("signal")
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGUSR1

    proc, pid_file = start("wait")
    assert proc.stdout.readline().endswith(" wait\n")
    proc.send_signal(signal.SIGTERM)  # forwarded: the script's own handler exits 143
    assert proc.wait(30) == 143
    proc, pid_file = start("wait")
    assert proc.stdout.readline().endswith(" wait\n")
    proc.kill()  # kill -9 of the forwarder: the zygote kills the child at once; wait() returns once it is dead
    assert proc.wait(30) == -signal.SIGKILL
    try:
        state = Path(f"/proc/{int(pid_file.read_text())}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:  # dead and reaped
        state = "gone"
    assert state in ("gone", "Z")  # Z: dead, its status not yet read by the zygote
