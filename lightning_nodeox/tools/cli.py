"""The ``nodeox`` command: ``coordinator``, ``launch`` and ``report``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from ..coordinator.config import DEFAULT_PORT, OUTER_OPTIMIZERS, CoordinatorConfig, OuterSettings
from ..core.settings import BLOCK_SIZES, CODECS, SCALE_DTYPES, Q4Settings


def _coordinator_options(p: argparse.ArgumentParser, *, for_launch: bool) -> None:
    p.add_argument("--hosts", type=int, required=True, help="hosts in the run")
    p.add_argument("--run-dir", type=Path, required=True, help="where events.jsonl and tb/ are written")
    default_bind = "127.0.0.1:0" if for_launch else f"127.0.0.1:{DEFAULT_PORT}"
    p.add_argument("--bind", default=default_bind, help=f"HOST:PORT to listen on (default {default_bind}; "
                   f"on a cluster use 0.0.0.0:{DEFAULT_PORT} with --token-file)")
    p.add_argument("--min-hosts", type=int, help="fewest deltas a round closes with (default 1; lowered to the hosts "
                   "that have not finished or left)")
    p.add_argument("--round-timeout", type=float, help="seconds a round waits for its last live hosts (default: "
                   "until every live host has sent)")
    p.add_argument("--lease", type=float, default=10.0, help="seconds a host stays expected without a heartbeat "
                   "(default 10)")
    p.add_argument("--snapshot-every", type=int, default=10, help="save the model to RUN_DIR/state every K rounds "
                   "(default 10; always at shutdown)")
    p.add_argument("--transfer-timeout", type=float, default=60.0, help="seconds any upload or download may take, "
                   "plus 1 s per MB (default 60)")
    p.add_argument("--fresh", action="store_true", help="start a new run even if RUN_DIR holds an unfinished one "
                   "(its records are moved to RUN_DIR/previous-TIME)")
    p.add_argument("--token-file", type=Path, help="file holding the bearer token hosts must send")
    p.add_argument("--insecure", action="store_true",
                   help="allow a --bind beyond loopback without --token-file (a network you trust entirely)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate to serve HTTPS with (with --tls-key)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--elastic", action="store_true", help="admit more than --hosts distinct host ids")
    p.add_argument("--block-size", type=int, default=64, choices=BLOCK_SIZES, help="q4 values per scale")
    p.add_argument("--scale-dtype", default="fp16", choices=SCALE_DTYPES, help="q4 scale type")
    p.add_argument("--codec", default="q4", choices=CODECS,
                   help="q4 (default); bf16 or fp32 send deltas unquantized, to measure what q4 costs")
    p.add_argument("--outer-optimizer", default="average", choices=OUTER_OPTIMIZERS,
                   help="how the mean delta becomes the sync: plain averaging, or DiLoCo's Nesterov momentum")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer learning rate (nesterov; default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer momentum (nesterov; default 0.9)")
    p.add_argument("--initial-model", type=Path, help="safetensors file to start from (default: the first host's)")
    p.add_argument("--threads", type=int, help="codec threads (default: this process's CPU quota)")
    p.add_argument("--rss-interval", type=float, default=2.0, help="seconds between memory samples")


def _read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise SystemExit(f"nodeox: cannot read --token-file {path}: {e}") from None
    if not token:
        raise SystemExit(f"nodeox: --token-file {path} is empty")
    return token


def _config(args: argparse.Namespace, bind: str) -> CoordinatorConfig:
    try:
        return CoordinatorConfig(
            hosts=args.hosts, run_dir=args.run_dir, bind=bind, min_hosts=args.min_hosts,
            round_timeout=args.round_timeout, token=_read_token(args.token_file), insecure=args.insecure,
            elastic=args.elastic, tls_cert=args.tls_cert, tls_key=args.tls_key,
            q4=Q4Settings(block_size=args.block_size, scale_dtype=args.scale_dtype, codec=args.codec),
            initial_model=args.initial_model, threads=args.threads, rss_interval=args.rss_interval,
            exit_when_done=not getattr(args, "keep_running", False), lease=args.lease,
            snapshot_every=args.snapshot_every, transfer_timeout=args.transfer_timeout, fresh=args.fresh,
            outer=OuterSettings(args.outer_optimizer, args.outer_lr, args.outer_momentum))
    except ValueError as e:
        raise SystemExit(f"nodeox: {e}") from None


def _passthrough(args: argparse.Namespace) -> list[str]:
    """Coordinator options given to launch, as coordinator command-line arguments."""
    out = ["--bind", args.bind, "--codec", args.codec, "--block-size", str(args.block_size), "--scale-dtype", args.scale_dtype,
           "--rss-interval", str(args.rss_interval), "--outer-optimizer", args.outer_optimizer,
           "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum), "--lease", str(args.lease),
           "--snapshot-every", str(args.snapshot_every), "--transfer-timeout", str(args.transfer_timeout)]
    if args.fresh:
        out.append("--fresh")
    for flag, value in (("--min-hosts", args.min_hosts), ("--round-timeout", args.round_timeout),
                        ("--token-file", args.token_file), ("--initial-model", args.initial_model),
                        ("--threads", args.threads), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if value is not None:
            out += [flag, str(value)]
    return out + [flag for flag in ("--insecure", "--elastic") if getattr(args, flag[2:])]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(prog="nodeox", description="lightning-nodeox: coordinator, launcher, report")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("coordinator", help="run the HTTP coordinator of a run")
    _coordinator_options(p, for_launch=False)
    p.add_argument("--keep-running", action="store_true", help="keep serving after every host has finished")
    p.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)

    p = sub.add_parser("launch", help="a coordinator and N hosts on this machine: nodeox launch ... -- COMMAND")
    _coordinator_options(p, for_launch=True)
    p.add_argument("--gpus-per-host", type=int, default=1,
                   help="GPUs each host sees (CUDA_VISIBLE_DEVICES); the host command uses Trainer(devices=K)")

    p = sub.add_parser("report", help="per-round phase tables of a run directory")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", type=Path, help="draw a timeline to this PNG file")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cmd == "coordinator":
        config = _config(args, args.bind)  # refuse a bad command line before importing torch
        from ..coordinator.server import serve

        return asyncio.run(serve(config, args.ready_file))
    if args.cmd == "launch":
        from .launch import launch

        config = _config(args, args.bind)  # validate before starting anything
        if args.gpus_per_host < 1:
            raise SystemExit(f"nodeox: --gpus-per-host must be at least 1, got {args.gpus_per_host}")
        return launch(args.hosts, args.run_dir, _passthrough(args), command, config.token, args.gpus_per_host,
                      config.tls_cert)
    if args.cmd == "report":
        from .report import main as report_main

        return report_main(args.run_dir, as_json=args.json, plot_to=args.plot)
    return 2
