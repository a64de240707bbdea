"""deploy/slurm/ run against stand-ins for Slurm (`srun`, `scontrol`) and for what it starts (`nodeox`,
`torchrun`, `python`), first on PATH: each records its argv and environment, so a test reads what every task
would get. The `srun` stand-in runs the task command once per task with the SLURM_* variables a real srun sets
(SLURM_PROCID 0..N-1, one task per node) and forwards SIGTERM to its tasks, as a real one does; the batch script
runs from a copy in a spool directory, as under slurmd."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_names import NODEOX_VARIABLES, unknown_flags
from helpers import REPO, wait_for

from lightning_nodeox.tools.cli import _parser

DEPLOY = REPO / "deploy" / "slurm"
SCRIPTS = sorted(p.name for p in DEPLOY.iterdir())
JOB_ID = "4242"
TOKEN = "s3cret-token"
WAIT = 20.0  # seconds any script or stand-in may take: they start no Python

SRUN = r"""#!/usr/bin/env bash
set -u
env -0 > "$FAKE_RECORD/srun.x.$$.env"
printf '%s\0' "$@" > "$FAKE_RECORD/srun.x.$$.tmp" && mv "$FAKE_RECORD/srun.x.$$.tmp" "$FAKE_RECORD/srun.x.$$.argv"
n=$FAKE_NODES
while [[ $# -gt 0 && $1 == -* ]]; do
    [[ $1 != --het-group=0 ]] || n=1  # the hetjob's coordinator component: one task
    shift
done
nodes=""
for ((i = 0; i < n; i++)); do nodes+="${nodes:+,}$FAKE_NODE_PREFIX$i"; done
pids=()
mkdir -p "$FAKE_RECORD/tasks"
for ((i = 0; i < n; i++)); do
    # each task is in the record of tasks (for scancel, as slurmstepd knows them) before it runs: a subshell that
    # records its own pid, then becomes the task
    (
        touch "$FAKE_RECORD/tasks/$BASHPID"
        SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=$n SLURM_STEP_NUM_NODES=$n \
        SLURM_STEP_NODELIST=$nodes SLURMD_NODENAME=$FAKE_NODE_PREFIX$i SLURM_GPUS_ON_NODE=$FAKE_GPUS exec "$@"
    ) &
    pids+=("$!")
done
# a real srun, sent SIGTERM, kills its tasks ("forcing job termination")
trap 'touch "$FAKE_RECORD/srun.x.$$.term"; kill -KILL "${pids[@]}" 2>/dev/null' TERM
status=0
for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null; do wait "$p"; done
    wait "$p" || status=$?
done
exit "$status"
"""

# scancel --signal=SIG JOBID: SIG to every task of the job's steps (not to the batch script)
SCANCEL = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$FAKE_RECORD/scancel"
[[ $1 == --signal=* ]] || exit 1
for task in "$FAKE_RECORD"/tasks/*; do kill -"${1#--signal=}" "${task##*/}" 2>/dev/null; done
exit 0
"""

SCONTROL = r"""#!/usr/bin/env bash
case "$1 ${2:-}" in
    "show job") echo "JobId=$4 JobName=nodeox UserId=u(1) JobState=RUNNING Command=$FAKE_COMMAND WorkDir=/w" ;;
    "show hostnames") tr ',' '\n' <<< "$3" ;;
    "requeue "*) printf '%s\n' "$@" > "$FAKE_RECORD/scontrol-requeue" ;;
    *) exit 1 ;;
esac
"""

# torchrun, python and nodeox: record; nodeox (and every one with FAKE_TASKS_WAIT=1) then runs until SIGTERM
TASK = r"""#!/usr/bin/env bash
set -u
name=$(basename "$0")
tag=$name.${SLURM_PROCID:-x}.$$
env -0 > "$FAKE_RECORD/$tag.env"  # then the argv: a call is whole once its argv is there
printf '%s\0' "$@" > "$FAKE_RECORD/$tag.tmp" && mv "$FAKE_RECORD/$tag.tmp" "$FAKE_RECORD/$tag.argv"
if [[ $name == nodeox ]]; then  # listening: RUN_DIR/coordinator.json, as the coordinator writes it
    args=("$@") run_dir="" port="" scheme=http
    for ((i = 0; i < ${#args[@]}; i++)); do
        case ${args[i]} in
            --run-dir) run_dir=${args[i + 1]} ;;
            --bind) port=${args[i + 1]##*:} ;;
            --tls-cert) scheme=https ;;
        esac
    done
    [[ $port != 0 ]] || port=45678
    run_dir=${run_dir:-$NODEOX_RUN_DIR}  # a command line without --run-dir (a misspelled one)
    echo "{\"url\": \"$scheme://0.0.0.0:$port\", \"pid\": $$, \"started\": 1.5}" > "$run_dir/coordinator.json"
fi
if [[ $name == nodeox || ${FAKE_TASKS_WAIT:-} == 1 ]]; then
    sleep infinity &
    sleeper=$!
    stopped() {
        echo TERM > "$FAKE_RECORD/$tag.term"
        kill "$sleeper"
        [[ $name == nodeox ]] && exit 1 || exit 143  # the coordinator saves and exits 1; a host exits 143
    }
    trap stopped TERM
    touch "$FAKE_RECORD/$tag.started"
    wait "$sleeper"
fi
"""


@dataclass
class Call:
    """One recorded call of a stand-in."""

    name: str
    procid: str
    argv: list[str]
    env: dict[str, str]
    stem: Path

    @property
    def terminated(self) -> bool:
        return Path(f"{self.stem}.term").exists()


class Cluster:
    """A fake Slurm cluster in ``root``: the stand-ins, a spool directory, a run directory on "shared storage"."""

    def __init__(self, root: Path, deploy: Path = DEPLOY) -> None:
        self.root, self.deploy = root, deploy
        self.bin, self.record, self.run_dir = root / "bin", root / "record", root / "run"
        for d in (self.bin, self.record, self.run_dir):
            d.mkdir()
        for name, text in (("srun", SRUN), ("scancel", SCANCEL), ("scontrol", SCONTROL), ("torchrun", TASK),
                           ("python", TASK), ("nodeox", TASK)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.procs: list[subprocess.Popen] = []
        self.address_file = self.run_dir / "coordinator.url"
        self.token_file = self.run_dir / "token"

    def ready_coordinator(self, url: str = "http://cpu7:8470") -> None:
        """What the coordinator's job leaves on shared storage."""
        self.address_file.write_text(url + "\n")
        self.token_file.write_text(TOKEN)

    def start(self, script: str, nodes: int = 3, gpus: int = 4, node_prefix: str = "gpu",
              **env: str) -> subprocess.Popen:
        """sbatch SCRIPT: a copy in the spool directory, run with the job's environment (and ``env``)."""
        spool = self.root / "spool" / f"job{JOB_ID}-{len(list(self.root.glob('spool/*')))}"
        spool.mkdir(parents=True)
        shutil.copy(self.deploy / script, spool / "slurm_script")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("NODEOX_", "SLURM_"))}
        full = {**base, "PATH": f"{self.bin}:{os.environ['PATH']}", "SLURM_JOB_ID": JOB_ID,
                "SLURM_SUBMIT_DIR": str(self.root), "NODEOX_RUN_DIR": str(self.run_dir), "ADDRESS_POLL": "0.01",
                "FAKE_RECORD": str(self.record), "FAKE_COMMAND": str(self.deploy / script), "FAKE_NODES": str(nodes),
                "FAKE_GPUS": str(gpus), "FAKE_NODE_PREFIX": node_prefix, **env}
        proc = subprocess.Popen(["bash", str(spool / "slurm_script")], env=full, cwd=self.root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def calls(self, name: str) -> list[Call]:
        found = []
        for argv in sorted(self.record.glob(f"{name}.*.argv")):
            env = dict(kv.split("=", 1) for kv in argv.with_suffix(".env").read_text().split("\0") if "=" in kv)
            found.append(Call(name, argv.name.split(".")[1], argv.read_text().split("\0")[:-1], env,
                              argv.with_suffix("")))
        return sorted(found, key=lambda c: c.procid)

    def kill_all(self) -> None:
        """SIGKILL to every process a job started that is still there (a failed test's)."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def clear(self) -> None:
        shutil.rmtree(self.record)
        self.record.mkdir()


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=WAIT)
    return proc.returncode, out


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path)
    yield made
    made.kill_all()


# The checks: what the scripts name exists in the code

def env_names_not_read(deploy: Path) -> list[str]:
    """Every ``NODEOX_*`` name the scripts use that the code does not read (``ENV_*`` of core/settings.py)."""
    used = {m for p in deploy.iterdir() for m in re.findall(r"\bNODEOX_[A-Z0-9_]+", p.read_text())}
    return sorted(used - NODEOX_VARIABLES)


def unknown_coordinator_flags(argv: list[str]) -> list[str]:
    """The flags of ``nodeox ARGV`` (a `nodeox coordinator` command line) that its parser does not have."""
    assert argv[0] == "coordinator"
    return unknown_flags(argv)


def coordinator_argv(cluster: Cluster, **env: str) -> list[str]:
    """The `nodeox` command line coordinator.sbatch runs (stopped with SIGTERM once it has written its address)."""
    proc = cluster.start("coordinator.sbatch", HOSTS="3", COORDINATOR_HOST="cpu7", **env)
    wait_for(lambda: cluster.address_file.exists() or proc.poll() is not None, WAIT, "the coordinator's address")
    proc.send_signal(signal.SIGTERM)
    status, out = finish(proc)
    assert status == 1, out  # the coordinator's status on SIGTERM (saved, resumable)
    [call] = cluster.calls("nodeox")
    return call.argv


# Tests

@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(DEPLOY / script)], capture_output=True).returncode == 0


def test_each_node_is_a_host_whose_id_is_its_task_rank_and_stays_after_a_requeue(cluster: Cluster) -> None:
    cluster.ready_coordinator()
    status, out = finish(cluster.start("hosts.sbatch", nodes=3, gpus=4, TRAIN="train.py --lr 1e-4"))
    assert status == 0, out
    [srun] = cluster.calls("srun")
    assert "--ntasks-per-node=1" in srun.argv and srun.argv[-2:] == [str(DEPLOY / "nodeox-task.sh"), "host"]
    calls = cluster.calls("torchrun")
    assert [c.env["NODEOX_HOST_ID"] for c in calls] == ["0", "1", "2"] == [c.env["SLURM_PROCID"] for c in calls]
    for c in calls:
        assert c.argv == ["--standalone", "--nproc-per-node", "4", "train.py", "--lr", "1e-4"]
        assert c.env["NODEOX_COORDINATOR_URL"] == "http://cpu7:8470"
        assert c.env["NODEOX_TOKEN"] == TOKEN
        assert c.env["NODEOX_NUM_HOSTS"] == "3" and c.env["NODEOX_RUN_DIR"] == str(cluster.run_dir)
    # requeued, the job lands on other nodes: the same ids
    cluster.clear()
    status, out = finish(cluster.start("hosts.sbatch", nodes=3, gpus=4, node_prefix="other"))
    assert status == 0, out
    assert [(c.env["SLURMD_NODENAME"], c.env["NODEOX_HOST_ID"]) for c in cluster.calls("torchrun")] == [
        ("other0", "0"), ("other1", "1"), ("other2", "2")]


def test_a_host_of_one_gpu_runs_python_and_ids_start_at_the_offset(cluster: Cluster) -> None:
    cluster.ready_coordinator("https://cpu7:8470")
    status, out = finish(cluster.start("hosts.sbatch", nodes=2, gpus=1, HOST_ID_OFFSET="10",
                                       CA_FILE="/shared/cert.pem"))
    assert status == 0, out
    assert cluster.calls("torchrun") == []
    calls = cluster.calls("python")
    assert [c.env["NODEOX_HOST_ID"] for c in calls] == ["10", "11"]
    assert all(c.argv == ["train.py"] and c.env["NODEOX_CA_FILE"] == "/shared/cert.pem"
               and c.env["NODEOX_COORDINATOR_URL"] == "https://cpu7:8470" for c in calls)


def test_a_host_spanning_nodes_runs_torchrun_with_its_first_node_as_rendezvous(cluster: Cluster) -> None:
    cluster.ready_coordinator()
    status, out = finish(cluster.start("hosts.sbatch", nodes=4, gpus=8, NODES_PER_HOST="2"))
    assert status == 0, out
    calls = cluster.calls("torchrun")
    assert [c.env["NODEOX_HOST_ID"] for c in calls] == ["0", "0", "1", "1"]
    assert all(c.env["NODEOX_NUM_HOSTS"] == "2" for c in calls)
    for c, head in zip(calls, ["gpu0", "gpu0", "gpu2", "gpu2"]):
        assert c.argv == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          f"{head}:29500", "--rdzv-id", f"{JOB_ID}-{c.env['NODEOX_HOST_ID']}", "train.py"]


def test_hosts_wait_for_the_coordinators_address(cluster: Cluster) -> None:
    proc = cluster.start("hosts.sbatch", nodes=2)
    wait_for(lambda: cluster.calls("srun"), WAIT, "srun")
    assert cluster.calls("torchrun") == [] and proc.poll() is None
    cluster.ready_coordinator("http://cpu3:9000")
    status, out = finish(proc)
    assert status == 0, out
    assert [c.env["NODEOX_COORDINATOR_URL"] for c in cluster.calls("torchrun")] == ["http://cpu3:9000"] * 2


def test_a_host_job_of_several_tasks_per_node_is_refused(cluster: Cluster) -> None:
    cluster.ready_coordinator()
    status, out = finish(cluster.start("hosts.sbatch", nodes=4, NODES_PER_HOST="3"))
    assert status == 2 and "do not make hosts of NODES_PER_HOST=3" in out
    assert cluster.calls("torchrun") == []


def test_the_coordinator_job_runs_flags_the_coordinator_has_and_writes_its_address(cluster: Cluster) -> None:
    argv = coordinator_argv(cluster, COORDINATOR_ARGS="--min-hosts 2 --outer-optimizer nesterov",
                            TLS_CERT="/c/cert.pem", TLS_KEY="/c/key.pem")
    assert unknown_coordinator_flags(argv) == []
    args = _parser().parse_args(argv)
    assert (args.hosts, args.run_dir, args.bind, args.token_file) == (
        3, cluster.run_dir, "0.0.0.0:8470", cluster.token_file)
    assert (args.min_hosts, args.outer_optimizer, str(args.tls_cert)) == (2, "nesterov", "/c/cert.pem")
    assert len(cluster.token_file.read_text()) == 48 and stat.S_IMODE(cluster.token_file.stat().st_mode) == 0o600
    assert not cluster.address_file.exists()  # removed when the coordinator stopped
    assert not (cluster.record / "scontrol-requeue").exists()  # SIGTERM: preempted or cancelled, not requeued here


def test_the_coordinator_address_names_its_node_and_the_port_it_bound(cluster: Cluster) -> None:
    proc = cluster.start("coordinator.sbatch", HOSTS="2", COORDINATOR_HOST="cpu7", COORDINATOR_PORT="0")
    wait_for(cluster.address_file.exists, WAIT, "the coordinator's address")
    assert cluster.address_file.read_text() == "http://cpu7:45678\n"
    assert [c.env.get("NODEOX_TOKEN") for c in cluster.calls("nodeox")] == [None]  # the token only in its file
    proc.send_signal(signal.SIGTERM)
    assert finish(proc)[0] == 1


def test_a_coordinator_job_near_its_time_limit_stops_the_coordinator_and_requeues_itself(cluster: Cluster) -> None:
    proc = cluster.start("coordinator.sbatch", HOSTS="2")
    wait_for(cluster.address_file.exists, WAIT, "the coordinator's address")
    proc.send_signal(signal.SIGUSR1)  # sbatch --signal=B:USR1@120
    status, out = finish(proc)
    assert status == 1, out
    [call] = cluster.calls("nodeox")
    assert call.terminated
    assert (cluster.record / "scontrol-requeue").read_text().split() == ["requeue", JOB_ID]


def test_a_misspelled_coordinator_flag_is_named(cluster: Cluster, tmp_path: Path) -> None:
    copy = tmp_path / "deploy-copy"
    shutil.copytree(DEPLOY, copy)
    task = copy / "nodeox-task.sh"
    task.write_text(task.read_text().replace('--run-dir "$NODEOX_RUN_DIR"', '--run-dri "$NODEOX_RUN_DIR"'))
    cluster.deploy = copy
    assert unknown_coordinator_flags(coordinator_argv(cluster)) == ["--run-dri"]


def test_every_nodeox_variable_the_scripts_use_is_read_by_the_code() -> None:
    assert env_names_not_read(DEPLOY) == []


def test_a_misspelled_nodeox_variable_is_named(tmp_path: Path) -> None:
    copy = tmp_path / "deploy-copy"
    shutil.copytree(DEPLOY, copy)
    task = copy / "nodeox-task.sh"
    task.write_text(task.read_text().replace("NODEOX_TOKEN", "NODEOX_TOKN"))
    assert env_names_not_read(copy) == ["NODEOX_TOKN"]


def test_near_the_time_limit_the_hosts_job_stops_every_host_with_sigterm_and_requeues_itself(cluster: Cluster) -> None:
    cluster.ready_coordinator()
    proc = cluster.start("hosts.sbatch", nodes=3, FAKE_TASKS_WAIT="1")
    wait_for(lambda: len(list(cluster.record.glob("torchrun.*.started"))) == 3, WAIT, "3 hosts")
    proc.send_signal(signal.SIGUSR1)  # sbatch --signal=B:USR1@300
    status, out = finish(proc)
    assert status == 143, out  # the hosts' status: they left the run
    assert [c.terminated for c in cluster.calls("torchrun")] == [True] * 3
    assert (cluster.record / "scancel").read_text().split() == ["--signal=TERM", JOB_ID]  # every step's tasks
    assert not [c for c in cluster.calls("srun") if c.terminated]  # srun would SIGKILL them
    assert (cluster.record / "scontrol-requeue").read_text().split() == ["requeue", JOB_ID]


def test_a_preempted_or_cancelled_hosts_job_leaves_sigterm_to_slurm_and_does_not_requeue(cluster: Cluster) -> None:
    """Slurm sends SIGTERM to the batch script and to every task itself (and requeues a preempted job)."""
    cluster.ready_coordinator()
    proc = cluster.start("hosts.sbatch", nodes=2, FAKE_TASKS_WAIT="1")
    wait_for(lambda: len(list(cluster.record.glob("torchrun.*.started"))) == 2, WAIT, "2 hosts")
    proc.send_signal(signal.SIGTERM)
    for task in (cluster.record / "tasks").iterdir():
        os.kill(int(task.name), signal.SIGTERM)  # what slurmstepd does
    status, out = finish(proc)
    assert status == 143, out
    assert [c.terminated for c in cluster.calls("torchrun")] == [True] * 2
    assert not [c for c in cluster.calls("srun") if c.terminated]
    assert not (cluster.record / "scontrol-requeue").exists() and not (cluster.record / "scancel").exists()


def test_the_hetjob_runs_the_coordinator_in_component_0_and_the_hosts_in_component_1(cluster: Cluster) -> None:
    proc = cluster.start("hetjob.sbatch", nodes=3, gpus=2, SLURM_JOB_NUM_NODES_HET_GROUP_1="3",
                         COORDINATOR_HOST="cpu0")
    # the hosts called, and the coordinator's stand-in trapping SIGTERM (it writes its address before it traps)
    wait_for(lambda: len(cluster.calls("torchrun")) == 3 and list(cluster.record.glob("nodeox.*.started")),
             WAIT, "3 hosts and the coordinator")
    proc.send_signal(signal.SIGUSR1)  # the hosts have finished; the coordinator (a stand-in) runs until stopped
    status, out = finish(proc)
    assert status == 1, out
    sruns = sorted((c.argv for c in cluster.calls("srun")), key=lambda a: a[0])
    assert [a[0] for a in sruns] == ["--het-group=0", "--het-group=1"]
    assert sruns[0][-1] == "coordinator" and sruns[1][-1] == "host"
    [coordinator] = cluster.calls("nodeox")
    assert unknown_coordinator_flags(coordinator.argv) == [] and coordinator.terminated
    assert _parser().parse_args(coordinator.argv).hosts == 3
    hosts = cluster.calls("torchrun")
    assert [c.env["NODEOX_HOST_ID"] for c in hosts] == ["0", "1", "2"]
    assert all(c.env["NODEOX_COORDINATOR_URL"] == "http://cpu0:8470" and c.env["NODEOX_TOKEN"]
               == cluster.token_file.read_text() and c.argv[:3] == ["--standalone", "--nproc-per-node", "2"]
               for c in hosts)
    assert (cluster.record / "scontrol-requeue").read_text().split() == ["requeue", JOB_ID]
