"""A nodeox run on a Ray cluster (``pip install "lightning-nodeox[ray]"``): one call starts the coordinator (and
relays, with sites) and every host as Ray actors, restarts those that die, grows the run when Ray finds resources,
and hands back each host's return value and the final model. See docs/clusters.md, section 13.

    import ray, lightning_nodeox.ray
    ray.init()
    result = lightning_nodeox.ray.run(train, {"lr": 1e-3}, hosts=4, run_dir="/data/runs/exp1")
    result.model.model_hash, result.model.tensors, result.hosts[0].value
"""

from .driver import RayRun, run, start
from .finalmodel import FinalModel
from .results import Ending, HostResult, RunResult
from .settings import RaySettings

__all__ = ["Ending", "FinalModel", "HostResult", "RayRun", "RaySettings", "RunResult", "run", "start"]
