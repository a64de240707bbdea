"""examples/finetune_vit.py as a nodeox run on a Ray cluster: the coordinator and every host as Ray actors, started
by one call (lightning_nodeox.ray.run). Flags this script does not know go to finetune_vit.py unchanged (its
default: a tiny ViT on the offline digits). See docs/clusters.md, section 13.

    python examples/ray_finetune.py --hosts 2 --max-steps 40           # a local Ray instance, started here
    ray job submit --working-dir . -- python examples/ray_finetune.py --hosts 2 --run-dir /data/runs/vit \\
        --gpus-per-host 1 --preset vit-b-study --data-dir /data
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import ray

import lightning_nodeox.ray as nodeox_ray

EXAMPLES = Path(__file__).resolve().parent


def train(config: dict) -> str:
    """One host: finetune_vit.py's main with ``config["argv"]``, in this actor (the job's working directory's
    examples/ when it has one, else the driver's)."""
    here = Path.cwd() / "examples"
    sys.path.insert(0, str(here if (here / "finetune_vit.py").exists() else config["examples"]))
    import finetune_vit

    sys.argv = ["finetune_vit.py", *config["argv"]]
    finetune_vit.main()
    return os.environ["NODEOX_HOST_ID"]


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="hosts the run starts with")
    p.add_argument("--run-dir", type=Path, default=Path("runs/ray-finetune"), help="the coordinator's run directory "
                   "(on the driver's machine; absolute under `ray job submit`, whose working directory is temporary)")
    p.add_argument("--sites", type=int, default=1, help="relays between the coordinator and the hosts")
    p.add_argument("--gpus-per-host", type=int, default=0, help="0: CPU hosts; K > 1: DDP inside each host")
    p.add_argument("--max-restarts", type=int, default=3, help="times Ray brings back each actor that dies")
    p.add_argument("--max-hosts", type=int, help="grow the run up to this many hosts as Ray finds resources")
    p.add_argument("--min-hosts", type=int, help="fewest deltas a round closes with")
    p.add_argument("--coordinator-args", default="", help='more `nodeox coordinator` flags, e.g. "--outer-optimizer '
                   'nesterov"')
    p.add_argument("--address", help="the Ray cluster to join (default: RAY_ADDRESS, else a local instance)")
    return p.parse_known_args()


def main() -> None:
    args, passed = parse_args()
    if args.gpus_per_host > 1:
        passed += ["--devices", str(args.gpus_per_host)]
    if args.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=args.address)
    else:  # a local instance: enough logical CPUs for the coordinator, its relays and every host, one each
        ray.init(num_cpus=max(os.cpu_count() or 1, 1 + (args.sites if args.sites > 1 else 0) + args.hosts))
    result = nodeox_ray.run(train, {"argv": passed, "examples": str(EXAMPLES)}, hosts=args.hosts,
                            run_dir=args.run_dir, sites=args.sites, gpus_per_host=args.gpus_per_host,
                            max_restarts=args.max_restarts, max_hosts=args.max_hosts, min_hosts=args.min_hosts,
                            coordinator_args=tuple(shlex.split(args.coordinator_args)))
    for host, part in result.hosts.items():
        print(f"host {host}: {part.ending.value}, {part.restarts} restarts" + (f": {part.error}" if part.error else ""))
    print(f"final model {result.model.model_hash} (round {result.model.round}, {len(result.model.tensors)} tensors); "
          f"run directory {result.run_dir}")
    sys.exit(1 if result.failed else 0)


if __name__ == "__main__":
    main()
