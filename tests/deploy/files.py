"""The deployment files under test, read once: the Dockerfile, the Kubernetes manifests, the
Prometheus scrape config and the Grafana dashboard (the queries of its panels and variables)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "tokenline-dashboard.json"


def manifests() -> list[dict[str, Any]]:
    """Every Kubernetes object in deploy/kubernetes (the kustomization file is not one)."""
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def manifest(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container() -> dict[str, Any]:
    """The tokenline container of the Deployment."""
    (only,) = manifest("Deployment", "tokenline")["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def pyproject_pins() -> dict[str, str]:
    """name -> exact version of every `name==version` requirement in pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return dict(r.split("==", 1) for r in requirements if "==" in r)


def pins_in(text: str) -> dict[str, str]:
    """name -> version of every `name==version` written in a command line or a Makefile."""
    return dict(re.findall(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.]*)", text))


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"] for target in panel["targets"]]


def with_grafana_variables(expr: str, model_name: str, rate_interval: str) -> str:
    """An expression as Grafana sends it for one selected model (a name with no regex characters),
    its template variables replaced with concrete values."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model_name", model_name)
