"""The modes of benchmarks/convergence.py as data: how each one runs (its kind, its `nodeox launch` options, its
NodeoxStrategy keyword arguments, its hosts, a slowed or stalled host), the lists of modes run by default, and the two
workloads with their defaults and the metric each is judged by."""

from __future__ import annotations

from dataclasses import dataclass

HOSTS = 2
STEPS = 600
LOCAL_STEPS = 20
BATCH_SIZE = 32
LR = 0.02
HIDDEN = 128
TEST_SIZE = 0.3
SLOWDOWN = 2.0
RUN_TIMEOUT = 180.0
LM_STEPS = 240  # about 85 s a run on the 2-core development machine (2 hosts, 0.32 s a step each)
LM_TIMEOUT = 600.0
SWEEP = (10, 20, 50, 100)  # --local-steps-sweep
RELAY_MODE, RELAY_BASELINE = "q4_relays", "q4_4hosts"  # goal: no accuracy lost beyond the baseline's seed spread
HET_HOSTS = 4
HET_PACE = 0.05  # seconds every step of a heterogeneous mode also takes (a GPU's step, not this CPU's)
STALL_SECONDS = 20.0
HET_SCENARIOS = {"even": {}, "slow3": {"slow": True, "slowdown": 3.0}, "stall": {"slow": True, "slowdown": 1.0,
                                                                                  "stalls": 2}}
HET_MERGES = {"sync": {}, "budget": {"strategy": {"round_seconds": "auto"}},
              **{f"async_{rule}": {"coordinator": ["--merge", "async", "--min-quorum", "3", "--staleness-rule", rule]}
                 for rule in ("age", "samples")}}

DILOCO = ["--outer-optimizer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"]
SPARSE_EARLIER = ["--codec", "sparse", "--chunking", "runs", "--levels", "q2", "--error-decay", "1", "--mean", "deltas"]

# mode -> how it runs: kind (ddp/nodeox), coordinator options, NodeoxStrategy keyword arguments, slowed host
MODES: dict[str, dict] = {
    "ddp": {"kind": "ddp"},
    "fp32": {"kind": "nodeox", "coordinator": ["--codec", "fp32"]},
    "q4": {"kind": "nodeox"},
    "q4_average": {"kind": "nodeox", "coordinator": ["--outer-optimizer", "average"]},
    "q4_nesterov": {"kind": "nodeox", "coordinator": DILOCO},
    "overlap_eager": {"kind": "nodeox", "strategy": {"overlap": "eager"}},
    "overlap_delayed": {"kind": "nodeox", "strategy": {"overlap": "delayed"}},
    "uneven": {"kind": "nodeox", "slow": True},
    "uneven_budget": {"kind": "nodeox", "slow": True, "strategy": {"round_seconds": "auto"}},
    "uneven_budget_overlap": {"kind": "nodeox", "slow": True, "strategy": {"round_seconds": "auto", "overlap": True}},
    RELAY_BASELINE: {"kind": "nodeox", "hosts": 4},
    RELAY_MODE: {"kind": "nodeox", "hosts": 4, "sites": 2},
    "q4_no_ef": {"kind": "nodeox", "strategy": {"error_feedback": False}},
    "q4_f4": {"kind": "nodeox", "strategy": {"fragments": 4}},
    "q2": {"kind": "nodeox", "coordinator": ["--codec", "q2"]},
    "q2_b256": {"kind": "nodeox", "coordinator": ["--codec", "q2", "--block-size", "256"]},
    "sparse_d1": {"kind": "nodeox", "coordinator": [*SPARSE_EARLIER, "--density", "0.01"]},
    "sparse_d3": {"kind": "nodeox", "coordinator": [*SPARSE_EARLIER, "--density", "0.03"]},
    "sparseloco": {"kind": "nodeox", "coordinator": ["--codec", "sparse", "--chunking", "tiles"]},
    "sparse": {"kind": "nodeox", "coordinator": ["--codec", "sparse"]},
    "int8": {"kind": "nodeox", "coordinator": ["--codec", "int8"]},
    "fp8": {"kind": "nodeox", "coordinator": ["--codec", "fp8"]},
    "bf16": {"kind": "nodeox", "coordinator": ["--codec", "bf16"]},
    **{f"q4_{outer}_h{h}": {"kind": "nodeox", "local_steps": h, "coordinator": options}
       for outer, options in (("average", ["--outer-optimizer", "average"]), ("nesterov", DILOCO)) for h in SWEEP},
}
# the epoch modes (issue 30): 3 hosts, --epochs passes over the training split, 5 local steps; the split shared out
# by hand (each host its third) or by the coordinator's data ledger; with faults, host 1 killed with -9 mid-way
# through epoch 1 and a host 3 joining then (--elastic; hand-sharded, it trains host 0's third again), and the
# coordinator killed with -9 mid-way through epoch 2 and started again
EPOCH_HOSTS = 3
EPOCHS = 15
EPOCH_LOCAL_STEPS = 5
DATA_UNIT = 32
KILL_AFTER = 6  # host 1's steps into epoch 1 (killed), host 0's into RESTART_EPOCH (the coordinator killed)
RESTART_EPOCH = 2
EPOCH_MODES = {"sharded3": {}, "sharded3_faults": {"faults": True}, "ledger": {"ledger": True},
               "ledger_faults": {"ledger": True, "faults": True}}
MODES.update({m: {"kind": "epochs", "hosts": EPOCH_HOSTS, **spec} for m, spec in EPOCH_MODES.items()})
HET_MODES = {f"het_{s}_{m}": {"kind": "nodeox", "hosts": HET_HOSTS, "pace": HET_PACE, **scenario, **merge}
             for s, scenario in HET_SCENARIOS.items() for m, merge in HET_MERGES.items()}
MODES.update(HET_MODES)
SWEEP_MODES = [m for m in MODES if MODES[m].get("local_steps")]
DEFAULT_MODES = [m for m in MODES if m not in ("bf16", "q2_b256", *SWEEP_MODES, *EPOCH_MODES, *HET_MODES)]
LM_MODES = ["ddp", "fp32", "bf16", "q4", "q4_nesterov", "q4_no_ef", "q2", "q2_b256", "sparse_d1", "sparse_d3",
            "sparseloco", "sparse", "int8", "fp8", "q4_f4"]



@dataclass(frozen=True)
class Metric:
    """What a workload's runs are judged by: ``key`` in a host's result; the summary holds ``KEY_mean``, ``_min``,
    ``_max`` and ``_stdev``, and ``vs_ddp`` (the mean's difference to DDP's, times ``scale``)."""

    key: str
    label: str
    scale: float  # the difference to DDP in the table's unit (accuracy: percentage points)
    unit: str

    @property
    def vs_ddp(self) -> str:
        return f"{self.key}_vs_ddp" + ("_points" if self.unit == "pt" else "")


@dataclass(frozen=True)
class Workload:
    """A workload's metric and its defaults (steps, inner learning rate and batch size per host, modes)."""

    metric: Metric
    steps: int
    lr: float
    batch_size: int
    modes: list[str]
    timeout: float


ACCURACY = Metric("accuracy", "accuracy", 100.0, "pt")
VAL_LOSS = Metric("val_loss", "val loss", 1.0, "")  # lower is better
WORKLOADS = {"digits": Workload(ACCURACY, STEPS, LR, BATCH_SIZE, DEFAULT_MODES, RUN_TIMEOUT),
             "lm": Workload(VAL_LOSS, LM_STEPS, 1e-3, 8, LM_MODES, LM_TIMEOUT)}
