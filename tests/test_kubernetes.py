"""deploy/kubernetes/ agrees with the code: every ``nodeox`` flag is one the real parser takes, every ``NODEOX_*``
variable one the code reads, ports, probes, mounts and Secret keys agree with the command line, and every object
loads into the official Kubernetes client's models without losing a field.

Rendering: ``kubectl kustomize`` (or ``kustomize build``) when installed, else :func:`render_here`, a minimal
kustomize (resources, components, JSON 6902 patches: all these manifests use), held to kubectl's output where both
exist.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from cli_names import NODEOX_VARIABLES, subcommands, unknown_flags

from lightning_nodeox.core import protocol, settings
from lightning_nodeox.tools import cli

kubernetes = pytest.importorskip("kubernetes", reason='pip install -e ".[test]" (the Kubernetes client)')

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
TARGETS = ["coordinator", "hosts", "hosts-jobset", "overlays/tls", "overlays/tls-store"]
MODELS = {"Service": "V1Service", "StatefulSet": "V1StatefulSet", "Job": "V1Job", "Secret": "V1Secret"}
COORDINATOR_SERVICE = "nodeox-coordinator"


# -- rendering ----------------------------------------------------------------------------------------------------


def _kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render_with_kustomize(target: str) -> list[dict]:
    out = subprocess.run([*_kustomize_command(), str(DEPLOY / target)], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _apply_op(doc: dict, op: dict) -> None:
    """One JSON 6902 operation (add, replace, test) on ``doc`` in place."""
    *parents, last = _pointer(op["path"])
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if op["op"] == "test":
        current = node[int(last)] if isinstance(node, list) else node[last]
        assert current == op["value"], f"patch test failed at {op['path']}: {current!r} != {op['value']!r}"
    elif op["op"] == "add" and isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace":
            assert (int(last) < len(node)) if isinstance(node, list) else last in node, f"nothing at {op['path']}"
        node[int(last) if isinstance(node, list) else last] = copy.deepcopy(op["value"])
    else:
        raise NotImplementedError(f"render_here takes add, replace and test, not {op['op']!r}")


def render_here(target: str | Path) -> list[dict]:
    """A kustomization's objects: its resources (files or kustomizations), then its components' and its own
    JSON 6902 patches, each on the objects its target (kind, name) selects."""
    root = DEPLOY / target
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for resource in spec.get("resources", []):
        path = root / resource
        docs += render_here(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    patches = [p for c in spec.get("components", []) for p in yaml.safe_load((root / c / "kustomization.yaml")
                                                                             .read_text()).get("patches", [])]
    for patch in patches + spec.get("patches", []):
        target_ = patch["target"]
        for doc in docs:
            name = doc["metadata"]["name"]
            if doc["kind"] == target_["kind"] and name == target_.get("name", name):
                for op in yaml.safe_load(patch["patch"]):
                    _apply_op(doc, op)
    return docs


def render(target: str) -> list[dict]:
    return render_with_kustomize(target) if _kustomize_command() else render_here(target)


def example_secrets() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all((DEPLOY / "secrets.example.yaml").read_text())}


# -- the checks -------------------------------------------------------------------------------------------------------


def pod_specs(doc: dict) -> list[dict]:
    """The pod templates' specs of a workload (JobSet: of each replicated job's Job)."""
    if doc["kind"] in ("StatefulSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "JobSet":
        return [r["template"]["spec"]["template"]["spec"] for r in doc["spec"]["replicatedJobs"]]
    return []


def _parse(argv: list[str], problems: list[str]) -> argparse.Namespace | None:
    """``nodeox ARGV`` through the real parser: each unknown flag named, then the whole line parsed."""
    parsers = subcommands()
    if not argv or argv[0] not in parsers:
        problems.append(f"nodeox {argv[:1]}: not a nodeox command ({', '.join(parsers)})")
        return None
    problems += [f"nodeox {argv[0]}: unknown flag {flag}" for flag in unknown_flags(argv)]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cli._parser().parse_args(argv)
    except SystemExit:
        problems.append(f"nodeox {' '.join(argv)}: refused by the parser: {err.getvalue().strip()}")
        return None


def _mounted(pod: dict, container: dict, file: str | Path) -> tuple[str, str | None, str | None]:
    """(volume name, Secret name, Secret key) of the volume that holds ``file`` in ``container``."""
    file = str(file)
    for mount in container.get("volumeMounts", []):
        base = mount["mountPath"].rstrip("/") + "/"
        if file == mount["mountPath"] or file.startswith(base):
            volume = next((v for v in pod.get("volumes", []) if v["name"] == mount["name"]), {"name": mount["name"]})
            if "secret" not in volume:
                return mount["name"], None, None
            rest = file[len(base):]
            items = volume["secret"].get("items")
            key = next((i["key"] for i in items if i["path"] == rest), None) if items else rest
            return mount["name"], volume["secret"]["secretName"], key
    return "", None, None


def _secret_key(problems: list[str], secrets: dict, name: str | None, key: str | None, what: str) -> None:
    if name is None:
        problems.append(f"{what}: not in a Secret volume")
    elif name not in secrets or key not in secrets[name].get("stringData", {}):
        problems.append(f"{what}: Secret {name} has no key {key} (secrets.example.yaml)")


def check(docs: list[dict], secrets: dict[str, dict]) -> list[str]:
    """What in ``docs`` disagrees with the code (an empty list: nothing)."""
    problems: list[str] = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    tls = False
    for doc in docs:
        claims = {t["metadata"]["name"] for t in doc.get("spec", {}).get("volumeClaimTemplates", [])}
        for pod in pod_specs(doc):
            for c in pod["containers"]:
                where = f"{doc['kind']} {doc['metadata']['name']}"
                for env in c.get("env", []):
                    if env["name"].startswith("NODEOX_") and env["name"] not in NODEOX_VARIABLES:
                        problems.append(f"{where}: {env['name']} is not a variable nodeox reads ({sorted(NODEOX_VARIABLES)})")
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        _secret_key(problems, secrets, ref["name"], ref["key"], f"{where}: env {env['name']}")
                for source in c.get("envFrom", []):
                    if source.get("secretRef", {}).get("name") not in secrets:
                        problems.append(f"{where}: envFrom names a Secret not in secrets.example.yaml: {source}")
                if c.get("command", [None])[0] == "nodeox":
                    tls |= _check_coordinator(problems, where, pod, c, claims, services, secrets)
    hosts = next((int(a.split("=")[1]) for d in docs for pod in pod_specs(d) for c in pod["containers"]
                  for a in c.get("args", []) if a.startswith("--hosts=")), None)
    for doc in docs:
        count = {"Job": lambda: doc["spec"]["completions"],
                 "JobSet": lambda: sum(r["replicas"] for r in doc["spec"]["replicatedJobs"])}.get(doc["kind"])
        if count and hosts is not None and count() != hosts:
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: {count()} hosts, "
                            f"the coordinator's --hosts={hosts}")
        for pod in pod_specs(doc):
            for c in pod["containers"]:
                num = next((e.get("value") for e in c.get("env", []) if e["name"] == settings.ENV_NUM_HOSTS), None)
                if num is not None and count and int(num) != count():
                    problems.append(f"{doc['kind']} {doc['metadata']['name']}: {settings.ENV_NUM_HOSTS}={num}, "
                                    f"{count()} hosts")
                if c.get("command", [None])[0] != "nodeox":
                    _check_host(problems, f"{doc['kind']} {doc['metadata']['name']}", pod, c, services, secrets, tls)
    return problems


def _check_coordinator(problems, where, pod, c, claims, services, secrets) -> bool:
    args = _parse(c["command"][1:] + c.get("args", []), problems)
    if args is None or args.cmd != "coordinator":
        return False
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    bind_port = int(args.bind.rsplit(":", 1)[1])
    if bind_port not in ports.values():
        problems.append(f"{where}: --bind {args.bind} but container ports {ports}")
    tls = args.tls_cert is not None
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c.get(kind, {}).get("httpGet")
        if get is None:
            problems.append(f"{where}: no {kind} on the health route")
            continue
        if get["path"] != protocol.HEALTH:
            problems.append(f"{where}: {kind} path {get['path']} is not the health route {protocol.HEALTH}")
        if ports.get(get["port"], get["port"]) != bind_port:
            problems.append(f"{where}: {kind} port {get['port']} is not --bind's {bind_port}")
        if get.get("scheme", "HTTP") != ("HTTPS" if tls else "HTTP"):
            problems.append(f"{where}: {kind} scheme {get.get('scheme', 'HTTP')} with tls={tls}")
    service = services.get(COORDINATOR_SERVICE)
    if service is None:
        problems.append(f"no Service {COORDINATOR_SERVICE}")
    else:
        for p in service["spec"]["ports"]:
            if ports.get(p["targetPort"], p["targetPort"]) != bind_port:
                problems.append(f"Service {COORDINATOR_SERVICE}: targetPort {p['targetPort']} is not "
                                f"--bind's {bind_port}")
    volume, _, _ = _mounted(pod, c, args.run_dir)
    if volume not in claims:
        problems.append(f"{where}: --run-dir {args.run_dir} is not on a volumeClaimTemplate ({sorted(claims)})")
    if args.token_file is None:
        problems.append(f"{where}: no --token-file")
    for flag, file in (("--token-file", args.token_file), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if file is not None:
            _secret_key(problems, secrets, *_mounted(pod, c, file)[1:], f"{where}: {flag} {file}")
    return tls


def _check_host(problems, where, pod, c, services, secrets, tls) -> None:
    env = {e["name"]: e for e in c.get("env", [])}
    for name in (settings.ENV_URL, settings.ENV_HOST_ID, settings.ENV_TOKEN):
        if name not in env:
            problems.append(f"{where}: no {name}")
    if settings.ENV_URL in env:
        url = urlsplit(env[settings.ENV_URL]["value"])
        service = services.get(url.hostname)
        if service is None or url.port not in [p["port"] for p in service["spec"]["ports"]]:
            problems.append(f"{where}: {settings.ENV_URL} {url.geturl()} is no Service's port")
        if url.scheme != ("https" if tls else "http"):
            problems.append(f"{where}: {settings.ENV_URL} {url.geturl()} with the coordinator's tls={tls}")
    if tls:
        if settings.ENV_CA_FILE not in env:
            problems.append(f"{where}: the coordinator serves TLS, no {settings.ENV_CA_FILE}")
        else:
            file = env[settings.ENV_CA_FILE]["value"]
            _secret_key(problems, secrets, *_mounted(pod, c, file)[1:], f"{where}: {settings.ENV_CA_FILE} {file}")
    if "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}):
        problems.append(f"{where}: no nvidia.com/gpu limit")


# -- the tests ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {target: render(target) for target in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_the_manifests_agree_with_the_command_line_and_the_code(rendered, target):
    assert check(rendered[target], example_secrets()) == []


def test_the_checker_names_a_misspelled_flag_and_variable(rendered):
    docs = copy.deepcopy(rendered["overlays/tls"])
    coordinator = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    coordinator["args"] = [a.replace("--run-dir", "--run-dri") for a in coordinator["args"]]
    host = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    next(e for e in host["env"] if e["name"] == "NODEOX_HOST_ID")["name"] = "NODEOX_HOSTID"
    problems = check(docs, example_secrets())
    assert any("unknown flag --run-dri" in p for p in problems), problems
    assert any("NODEOX_HOSTID is not a variable" in p for p in problems), problems


def test_the_checker_names_wrong_paths_ports_and_keys(rendered):
    docs = copy.deepcopy(rendered["overlays/tls"])
    coordinator = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    coordinator["readinessProbe"]["httpGet"]["path"] = "/health"
    coordinator["args"] = [a.replace("0.0.0.0:8470", "0.0.0.0:8471") for a in coordinator["args"]]
    coordinator["args"] = [a.replace("/nodeox/run", "/data/run") for a in coordinator["args"]]
    next(d for d in docs if d["kind"] == "Job")["spec"]["completions"] = 5
    secrets = example_secrets()
    del secrets["nodeox-tls"]["stringData"]["ca.crt"]
    problems = "\n".join(check(docs, secrets))
    for said in ("readinessProbe path /health", "--bind 0.0.0.0:8471", "--run-dir /data/run",
                 "NODEOX_CA_FILE /nodeox/tls/ca.crt: Secret nodeox-tls has no key ca.crt",
                 "Job nodeox-hosts: 5 hosts, the coordinator's --hosts=4", "NODEOX_NUM_HOSTS=4, 5 hosts"):
        assert said in problems, problems


def _quantities_as_text(obj):
    """``obj`` with the numbers of resource limits and requests as text (``nvidia.com/gpu: 1`` -> ``"1"``), as the
    client's models hold quantities."""
    if isinstance(obj, list):
        return [_quantities_as_text(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    return {k: {q: str(n) for q, n in v.items()} if k in ("limits", "requests") and isinstance(v, dict)
            else _quantities_as_text(v) for k, v in obj.items()}


def _load(kind: str, obj: dict):
    """``obj`` as the client's model, and back (quantities as text): a field the model does not know (a typo) is
    lost on the way."""
    client = kubernetes.client.ApiClient()

    class Response:
        data = json.dumps(obj)

    model = client.deserialize(Response, kind)
    return model, client.sanitize_for_serialization(model)


def test_every_object_loads_into_the_kubernetes_client_models(rendered):
    objects = [d for docs in rendered.values() for d in docs] + list(example_secrets().values())
    seen = set()
    for obj in objects:
        if obj["kind"] == "JobSet":
            continue
        model, back = _load(MODELS[obj["kind"]], obj)
        assert back == _quantities_as_text(obj), \
            f"{obj['kind']} {obj['metadata']['name']} lost or changed fields in the client's model"
        seen.add(obj["kind"])
    assert seen == set(MODELS)


def test_the_jobset_has_jobsets_shape_and_its_templates_load(rendered):
    for target in ("hosts-jobset", "overlays/tls-store"):
        jobset = next(d for d in rendered[target] if d["kind"] == "JobSet")
        assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
        assert set(jobset["spec"]) <= {"network", "failurePolicy", "successPolicy", "replicatedJobs", "suspend",
                                       "startupPolicy", "coordinator", "ttlSecondsAfterFinished", "managedBy"}
        assert jobset["spec"]["network"]["enableDNSHostnames"] is True
        for job in jobset["spec"]["replicatedJobs"]:
            assert set(job) <= {"name", "replicas", "template", "dependsOn"} and job["replicas"] >= 1
            _, back = _load("V1JobTemplateSpec", job["template"])
            assert back == _quantities_as_text(job["template"])
            pod = job["template"]["spec"]["template"]
            assert _load("V1PodTemplateSpec", pod)[1] == _quantities_as_text(pod)
            assert job["template"]["spec"]["completionMode"] == "Indexed"
            args = pod["spec"]["containers"][0]["args"]
            nnodes = next(a for a in args if a.startswith("--nnodes="))
            assert int(nnodes.split("=")[1]) == job["template"]["spec"]["completions"]


@pytest.mark.skipif(_kustomize_command() is None, reason="neither kubectl nor kustomize is installed")
@pytest.mark.parametrize("target", TARGETS)
def test_the_minimal_renderer_agrees_with_kustomize(target):
    def key(d):
        return d["kind"], d["metadata"]["name"]

    assert sorted(render_here(target), key=key) == sorted(render_with_kustomize(target), key=key)
