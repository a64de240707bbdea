"""The ``nodeox`` command: ``coordinator``, ``relay``, ``launch``, ``report`` and ``status``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path

from ..coordinator.config import DEFAULT_PORT, CoordinatorConfig, OuterSettings
from ..coordinator.outer import outer_names
from ..coordinator.merging import MODES, MergeSettings, rule_names
from ..core import logs
from ..core.codecs.settings import ALIASES, CODEC_NAMES, REGISTRY, CodecSettings, Q4Settings, settings_for
from ..core.settings import ENV_CA_FILE
from ..relay.config import RelayConfig

LAUNCH_BIND = "127.0.0.1:0"  # launch's coordinator serves this machine's hosts only, on a free port


def _defaults(cls) -> dict[str, object]:
    """The defaults of a settings dataclass's fields: the one place each is written."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def _setting_flags() -> dict[str, tuple[Field, list[str]]]:
    """Every codec setting (a flag each): its field (of the first codec that has it) and the codecs that take it."""
    flags: dict[str, tuple[Field, list[str]]] = {}
    for cls in REGISTRY.values():
        for f in fields(cls):
            flags.setdefault(f.name, (f, []))[1].append(cls.name)
    return flags


SETTING_FLAGS = _setting_flags()
_FLAG_TYPES = {"int": int, "float": float, "str": str}  # a settings field's annotation (text), as argparse's type


def _codec_options(p: argparse.ArgumentParser) -> None:
    """``--codec`` and a flag for each setting of any codec (``--block-size``, ``--density``, ...): given to a codec
    without it, :func:`_codec_settings` refuses it."""
    p.add_argument("--codec", default=Q4Settings.name, choices=CODEC_NAMES,
                   help="q4 (default); q2: 2-bit, about half of q4's bytes; int8 (absmax / 127) or fp8 (e4m3, "
                   "absmax / 448): one byte a value and a scale a block, 1.9x q4's bytes; bf16 or fp32 send deltas "
                   "unquantized, to measure what q4 costs; sparse: SparseLoCo's recipe, the top --density of each "
                   "run of 4096 values with 2-bit values and decayed error feedback (64 of 4096 by default: 0.053x "
                   "q4's bytes; --chunking tiles: 64x64 chunks of a matrix, as SparseLoCo cuts them); "
                   + "; ".join(f"{alias}: {base} at " + ", ".join(f"{k} {v}" for k, v in preset.items())
                               for alias, (base, preset) in ALIASES.items()))
    for name, (f, codecs) in SETTING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=_FLAG_TYPES[f.type], help=f"{f.metadata['help']}; "
                       f"codecs {', '.join(codecs)} (default {f.default})".replace("%", "%%"))


def _codec_settings(args: argparse.Namespace) -> CodecSettings:
    """The settings of ``--codec`` with the codec flags given (a ValueError naming the fix for one it lacks)."""
    given = {name: getattr(args, name) for name in SETTING_FLAGS if getattr(args, name) is not None}
    return settings_for(args.codec, **given)


def _serving_options(p: argparse.ArgumentParser, *, bind: str) -> None:
    """The flags of what serves hosts (``nodeox coordinator``, ``launch`` and ``relay`` alike), defaults from the
    coordinator's settings."""
    run = _defaults(CoordinatorConfig)
    p.add_argument("--hosts", type=int, required=True, help="hosts in the run")
    p.add_argument("--run-dir", type=Path, required=True, help="where events.jsonl and tb/ are written")
    p.add_argument("--bind", default=bind, help="HOST:PORT to listen on (default %(default)s; "
                   f"on a cluster use 0.0.0.0:{DEFAULT_PORT} with --token-file)")
    p.add_argument("--min-hosts", type=int, help="fewest deltas a round closes with (default 1; lowered to the hosts "
                   "that have not finished or left)")
    p.add_argument("--round-timeout", type=float, help="seconds a round waits for its last live hosts (default: "
                   "until every live host has sent)")
    p.add_argument("--lease", type=float, default=run["lease"], help="seconds a host stays expected without a "
                   "heartbeat (default %(default)g)")
    p.add_argument("--no-hosts-timeout", type=float, default=run["no_hosts_timeout"], help="seconds the run waits "
                   "with no live host before the coordinator stops, the run saved unfinished (started again, it "
                   "resumes; default %(default)g)")
    p.add_argument("--final-wait", type=float, default=run["final_wait"], help="seconds a completed run waits, at "
                   "most, for the hosts of its final round that have not left (a paused one) to fetch the final "
                   "model before the coordinator exits (default %(default)g)")
    p.add_argument("--snapshot-every", type=int, default=run["snapshot_every"], help="save the model to "
                   "RUN_DIR/state every K rounds (default %(default)s; always at shutdown)")
    p.add_argument("--transfer-timeout", type=float, default=run["transfer_timeout"], help="seconds any upload or "
                   "download may take, plus 1 s per MB (default %(default)g)")
    p.add_argument("--idle-timeout", type=float, default=run["idle_timeout"], help="seconds a connection may wait "
                   "for its next request's headers before it is closed (default %(default)g)")
    p.add_argument("--max-connections", type=int, help="connections open at once; beyond it the one waiting "
                   "longest for a request is closed (default: from the open-file limit, raised to its hard limit)")
    p.add_argument("--fresh", action="store_true", help="start a new run even if RUN_DIR holds an unfinished one "
                   "(its records are moved to RUN_DIR/previous-TIME)")
    p.add_argument("--token-file", type=Path, help="file holding the bearer token hosts must send")
    p.add_argument("--insecure", action="store_true",
                   help="allow a --bind beyond loopback without --token-file (a network you trust entirely)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate to serve HTTPS with (with --tls-key)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--elastic", action="store_true", help="admit more than --hosts distinct host ids")
    p.add_argument("--threads", type=int, help="codec threads (default: this process's CPU quota)")
    p.add_argument("--rss-interval", type=float, default=run["rss_interval"],
                   help="seconds between memory samples (default %(default)g)")
    p.add_argument("--gpu-hour-price", type=float, metavar="P", help="price of one GPU for one hour: the status "
                   "page says what the hosts' waiting cost")
    p.add_argument("--store", metavar="URL", help="the run's object store, s3://bucket/prefix (any S3-compatible "
                   "service; AWS_ENDPOINT_URL for one other than AWS) or file:///path (a shared filesystem): syncs and "
                   "the model go through it once, and the run's state is copied there (docs/clusters.md)")
    p.add_argument("--store-deltas", action="store_true", help="hosts write their deltas to the store too (a "
                   "presigned PUT per piece) and the coordinator reads them there, instead of over HTTP")
    p.add_argument("--store-own-credentials", action="store_true", help="hosts read the store with credentials of "
                   "their own (its s3:// addresses) instead of presigned URLs")
    p.add_argument("--store-lease", type=float, default=run["store_lease"], help=argparse.SUPPRESS)
    merge = _defaults(MergeSettings)  # a relay closes its site's rounds by the same rules
    p.add_argument("--merge", default=merge["mode"], choices=MODES, help="sync (default): a round waits for every "
                   "live host and a late delta is dropped; async: a round closes on --min-quorum deltas and a late "
                   "delta is merged into the round open when it arrives (docs/algorithms.md)")
    p.add_argument("--min-quorum", type=int, metavar="K", help="--merge async: the fewest deltas a round closes with")
    p.add_argument("--grace", type=float, metavar="S", help="--merge async: the longest a round waits, after its "
                   "quorum, for a host whose delta is due (default: half the median time between two deltas)")
    p.add_argument("--max-staleness", type=int, default=merge["max_staleness"], metavar="N", help="--merge async: "
                   "a delta more than N rounds behind is refused and its host fetches the model (default %(default)s)")
    p.add_argument("--staleness-rule", default=merge["staleness_rule"], choices=rule_names(), help="--merge async: "
                   "how a late delta is weighted: age (samples / (1 + rounds late)) or samples (default %(default)s)")


def _coordinator_options(p: argparse.ArgumentParser, *, bind: str) -> None:
    """The coordinator's flags (``nodeox coordinator`` and ``nodeox launch`` alike), defaults from its settings."""
    outer = _defaults(OuterSettings)
    _serving_options(p, bind=bind)
    _codec_options(p)
    p.add_argument("--outer-optimizer", default=outer["name"], choices=outer_names(),
                   help="how the mean delta becomes the sync: plain averaging, or DiLoCo's Nesterov momentum "
                   "(default %(default)s)")
    p.add_argument("--outer-lr", type=float, default=outer["lr"],
                   help="outer learning rate (nesterov; default %(default)g)")
    p.add_argument("--outer-momentum", type=float, default=outer["momentum"],
                   help="outer momentum (nesterov; default %(default)g)")
    p.add_argument("--initial-model", type=Path, help="safetensors file to start from (default: the first host's)")
    p.add_argument("--data-unit", type=int, default=_defaults(CoordinatorConfig)["data_unit"],
                   help="samples per unit of the data ledger, which shares out each epoch to hosts that declare their "
                   "data (default %(default)s)")


def _relay_options(p: argparse.ArgumentParser) -> None:
    """The flags of ``nodeox relay`` (beside its hosts' side, :func:`_serving_options`)."""
    p.add_argument("--upstream", required=True, help="URL of the root coordinator, or of another relay")
    p.add_argument("--upstream-token-file", type=Path, help="file holding the upstream's bearer token")
    p.add_argument("--id", help="the relay's host id upstream (default: the run directory's name)")
    _serving_options(p, bind=_defaults(CoordinatorConfig)["bind"])
    p.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)


def _launch_options(p: argparse.ArgumentParser) -> None:
    """The flags of ``nodeox launch`` itself (every other flag it takes goes to its coordinator)."""
    p.add_argument("--gpus-per-host", type=int, default=1,
                   help="GPUs each host sees (CUDA_VISIBLE_DEVICES); the host command uses Trainer(devices=K)")
    p.add_argument("--sites", type=int, default=1,
                   help="spread the hosts over this many sites, each behind a `nodeox relay` under the coordinator "
                   "(default 1: every host straight to the coordinator)")


RELAYED = ("round_timeout", "lease", "no_hosts_timeout", "final_wait", "snapshot_every", "transfer_timeout", "idle_timeout",
           "max_connections", "fresh", "threads", "rss_interval",
           "gpu_hour_price")  # launch's flags its relays take as well


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


def _config(args: argparse.Namespace) -> CoordinatorConfig:
    try:
        return CoordinatorConfig(
            hosts=args.hosts, run_dir=args.run_dir, bind=args.bind, min_hosts=args.min_hosts,
            round_timeout=args.round_timeout, token=_read_token(args.token_file), insecure=args.insecure,
            elastic=args.elastic, tls_cert=args.tls_cert, tls_key=args.tls_key,
            codec=_codec_settings(args) if "codec" in args else Q4Settings(),  # a relay takes its upstream's codec
            initial_model=getattr(args, "initial_model", None), threads=args.threads, rss_interval=args.rss_interval,
            exit_when_done=not getattr(args, "keep_running", False), lease=args.lease,
            no_hosts_timeout=args.no_hosts_timeout, final_wait=args.final_wait,
            snapshot_every=args.snapshot_every, transfer_timeout=args.transfer_timeout, fresh=args.fresh,
            idle_timeout=args.idle_timeout, max_connections=args.max_connections, gpu_hour_price=args.gpu_hour_price,
            store=args.store, store_own_credentials=args.store_own_credentials,
            store_deltas=args.store_deltas, store_lease=args.store_lease,
            data_unit=getattr(args, "data_unit", 256),  # a relay shares out no data (it has no such flag)
            outer=OuterSettings(args.outer_optimizer, args.outer_lr, args.outer_momentum)
            if "outer_optimizer" in args else OuterSettings(),  # nor outer-optimizer flags: it never steps
            merge=_merge_settings(args))
    except ValueError as e:
        raise SystemExit(f"nodeox: {e}") from None


def _merge_settings(args: argparse.Namespace) -> MergeSettings:
    """``--merge`` and its flags (a ValueError naming the fix for one given without ``--merge async``)."""
    if "merge" not in args:
        return MergeSettings()
    if args.merge == "sync":
        given = [f for f, v in (("--min-quorum", args.min_quorum), ("--grace", args.grace)) if v is not None]
        if given:
            many = len(given) > 1
            raise ValueError(f"{' and '.join(given)} {'go' if many else 'goes'} with --merge async; add --merge async "
                             f"(or drop {'them' if many else 'it'})")
    return MergeSettings(args.merge, args.min_quorum, args.grace, args.max_staleness, args.staleness_rule)


def _relay_config(args: argparse.Namespace) -> RelayConfig:
    try:
        return RelayConfig(upstream=args.upstream, relay_id=args.id or RelayConfig.default_id(args.run_dir),
                           token=_read_token(args.upstream_token_file), ca_file=os.environ.get(ENV_CA_FILE))
    except ValueError as e:
        raise SystemExit(f"nodeox: {e}") from None


def coordinator_argv(launch_argv: list[str]) -> list[str]:
    """The coordinator's command line of ``nodeox launch LAUNCH_ARGV``: the options as they were given, less
    launch's own, after launch's default ``--bind`` (a ``--bind`` given comes later and wins)."""
    own = argparse.ArgumentParser(add_help=False)
    _launch_options(own)
    return ["--bind", LAUNCH_BIND, *own.parse_known_args(launch_argv)[1]]


def relay_argv(launch_argv: list[str]) -> list[str]:
    """The options ``nodeox launch --sites S LAUNCH_ARGV`` gives each relay beside its own: the serving flags given
    (:data:`RELAYED`; ``--min-hosts`` counts the root's sites, not a site's hosts), and ``--token-file`` as both the
    relay's and its upstream's."""
    serving = argparse.ArgumentParser(add_help=False)
    _serving_options(serving, bind=LAUNCH_BIND)
    given = serving.parse_known_args(launch_argv)[0]
    argv: list[str] = []
    for action in serving._actions:
        value = getattr(given, action.dest, None)
        if action.dest not in RELAYED or value is None or value == action.default:
            continue
        argv += [action.option_strings[0]] if value is True else [action.option_strings[0], str(value)]
    if given.token_file is not None:
        argv += ["--token-file", str(given.token_file), "--upstream-token-file", str(given.token_file)]
    return argv


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodeox",
                                     description="lightning-nodeox: coordinator, relay, launcher, report, status")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("coordinator", help="run the HTTP coordinator of a run")
    _coordinator_options(p, bind=_defaults(CoordinatorConfig)["bind"])
    p.add_argument("--keep-running", action="store_true", help="keep serving after every host has finished")
    p.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)

    p = sub.add_parser("relay", help="a site relay: a coordinator to its hosts, one host to its upstream")
    _relay_options(p)

    p = sub.add_parser("launch", help="a coordinator and N hosts on this machine: nodeox launch ... -- COMMAND")
    _coordinator_options(p, bind=LAUNCH_BIND)
    _launch_options(p)

    p = sub.add_parser("report", help="a run directory's summary, or its per-round phase tables")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", type=Path, help="draw a timeline to this PNG file")
    p.add_argument("--rounds", nargs="?", const="", metavar="A:B", help="per-round tables instead of the summary: "
                   "every round, or rounds A to B (both included; A: and :B too); with --plot, its timeline's rounds")
    p.add_argument("--gpu-hour-price", type=float, metavar="P", help="price of one GPU for one hour: the summary "
                   "starts with what the run and its waiting cost")

    p = sub.add_parser("status", help="a running run's state in a terminal (the status page's picture)")
    p.add_argument("url", metavar="URL|RUN_DIR", help="the coordinator's (or a relay's) URL, or its run directory")
    p.add_argument("--watch", action="store_true", help="redraw until the run completes or fails (Ctrl-C stops)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default %(default)g)")
    p.add_argument("--token-file", type=Path, help="file holding the coordinator's bearer token (else NODEOX_TOKEN)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, handlers=[logs.handler()])
    if args.cmd == "coordinator":
        config = _config(args)  # refuse a bad command line before importing torch
        from ..coordinator.server import serve

        return asyncio.run(serve(config, args.ready_file))
    if args.cmd == "relay":
        config, relay = _config(args), _relay_config(args)
        from ..relay.run import serve as serve_relay

        return asyncio.run(serve_relay(config, relay, args.ready_file))
    if args.cmd == "launch":
        from .launch import launch
        from .topology import spread

        config = _config(args)  # validate before starting anything
        if args.gpus_per_host < 1:
            raise SystemExit(f"nodeox: --gpus-per-host must be at least 1, got {args.gpus_per_host}")
        try:
            spread(args.hosts, args.sites)
        except ValueError as e:
            raise SystemExit(f"nodeox: {e}") from None
        if args.sites > 1:
            try:
                replace(config, hosts=args.sites)  # the root's own settings, one host per relay
            except ValueError as e:
                raise SystemExit(f"nodeox: with --sites {args.sites} the coordinator's hosts are its "
                                 f"{args.sites} relays: {e}") from None
        return launch(config, coordinator_argv(argv[1:]), command, args.gpus_per_host, sites=args.sites,
                      relay_args=relay_argv(argv[1:]))
    if args.cmd == "report":
        from .report import main as report_main

        return report_main(args.run_dir, as_json=args.json, plot_to=args.plot, rounds=args.rounds,
                           price=args.gpu_hour_price)
    if args.cmd == "status":
        from .status import main as status_main

        if not args.interval > 0:
            raise SystemExit(f"nodeox: --interval must be positive seconds, got {args.interval}")
        return status_main(args.url, token=_read_token(args.token_file), watch=args.watch, interval=args.interval)
    return 2
