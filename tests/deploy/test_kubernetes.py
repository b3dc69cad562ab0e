"""The Kubernetes manifests: valid against the Kubernetes JSON schemas (kubernetes-validate bundles
them, so this runs offline), and consistent with each other, the image, the scrape config and the
memory plan. Applying them to a cluster is not done here."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.files import KUBERNETES, PROMETHEUS_CONFIG, container, flag, manifest, manifests
from tokenline.model.config import ModelConfig
from tokenline.model.plan import GIB, plan_memory

# The oldest Kubernetes minor still in upstream support when this was written, and the newest the
# validator bundles: strict mode also rejects fields a schema does not know (typos).
VERSIONS = ["1.32.0", kubernetes_validate.latest_version()]
QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def quantity_bytes(value: str) -> int:
    return int(value[:-2]) * QUANTITY[value[-2:]] if value[-2:] in QUANTITY else int(value)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version: str) -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "Secret"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_deployment() -> None:
    broken = copy.deepcopy(manifest("Deployment", "tokenline"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)
    del broken["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=False)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_probes_readiness_on_health_liveness_on_live_startup_covers_model_load() -> None:
    c = container()
    port_names = {p["name"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in port_names
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # the e2e server's own start-up bound


def test_resources_cover_the_memory_plan(default_model_dir: Path) -> None:
    c = container()
    kv_gib = float(flag(c["args"], "--kv-cache-memory"))
    seq_len = int(flag(c["args"], "--max-model-len"))
    plan = plan_memory(ModelConfig.from_dir(default_model_dir), 0.25 + kv_gib, seq_len)
    assert plan.max_sequences >= 1  # the KV budget holds at least one full-length sequence
    requested = quantity_bytes(c["resources"]["requests"]["memory"])
    limit = quantity_bytes(c["resources"]["limits"]["memory"])
    assert requested >= plan.weight_bytes + kv_gib * GIB + GIB  # + ~1 GiB for the two Python processes
    assert limit >= requested
    threads = next(e["value"] for e in c["env"] if e["name"] == "OMP_NUM_THREADS")
    assert int(threads) == int(c["resources"]["limits"]["cpu"])


def test_api_key_comes_from_the_secret_as_vllm_api_key() -> None:
    (env,) = [e for e in container()["env"] if e["name"] == "VLLM_API_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["key"] in manifest("Secret", ref["name"])["stringData"]


def test_writable_paths_are_volumes_under_a_read_only_root() -> None:
    c = container()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert str(Path(flag(c["args"], "--usage-db")).parent) in mounts
    assert {"/var/lib/tokenline/kernels", "/tmp"} <= mounts  # compiled CPU kernels, temp files


def test_services_select_the_pods_and_the_scrape_config_finds_them() -> None:
    deployment = manifest("Deployment", "tokenline")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(flag(c["args"], "--port"))
    assert ports["metrics"] == int(flag(c["args"], "--metrics-port"))
    api, pods = manifest("Service", "tokenline"), manifest("Service", "tokenline-pods")
    for service in (api, pods):
        assert service["spec"]["selector"].items() <= pod_labels.items()
    assert [p["targetPort"] for p in api["spec"]["ports"]] == ["http"]  # /metrics stays inside
    assert [p["targetPort"] for p in pods["spec"]["ports"]] == ["metrics"]
    assert pods["spec"]["clusterIP"] == "None"  # headless: one DNS record per pod

    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"][0].split(".")[0] == "tokenline-pods" and sd["port"] == ports["metrics"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == job["metrics_path"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
