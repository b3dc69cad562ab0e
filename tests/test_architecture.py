"""The package rules of ARCHITECTURE.md, checked on the code: who may import whom, no loops, and
the processes that must never load torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import tokenline

ROOT = Path(tokenline.__file__).parent

# package -> packages it may import. A value that names a module ("engine.messages") allows only
# that module: records shared across a boundary, not the code behind them.
ALLOWED: dict[str, set[str]] = {
    "sampling_params": set(),
    "model": {"sampling_params", "store"},
    "store": set(),
    "engine": {"model", "sampling_params", "spec_decode", "structured_output"},
    "structured_output": {"model.host_memory", "sampling_params"},
    "spec_decode": set(),
    "frontend": {"engine.messages", "structured_output", "sampling_params"},
    "gateway": {"engine.messages", "store.model_store"},
    "api": {"gateway", "frontend", "engine", "model.config", "store.model_store", "router", "sampling_params",
            "__version__"},
    # routing policies and fleet clients: engine records and clients, never a model
    "router": {"engine", "sampling_params"},
    "llm": {"frontend", "engine", "store.model_store", "sampling_params"},
    # bench serve reads /metrics deltas with top's helpers (top imports no tokenline code)
    "bench": {"engine", "frontend", "llm", "model", "sampling_params", "store", "top"},
    "cli": {"api", "bench", "engine", "frontend", "gateway", "llm", "model", "router", "sampling_params", "serve_args", "store",
            "sim", "top", "trace_walk"},
    # `tokenline simulate` / `bench calibrate`: the real scheduler and KV books on a simulated clock,
    # reported in bench serve's shape; calibrate measures the machine with bench roofline's probes
    "sim": {"bench.multiturn", "bench.results", "bench.roofline", "bench.serve", "engine", "model", "router", "sampling_params"},
    "top": set(),  # `tokenline top` reads any server's /metrics over HTTP: no tokenline code
    "trace_walk": {"engine", "frontend", "gateway.ledger", "llm", "model", "sampling_params"},
    # cli's table of vLLM serve flags; JSON-object flags are read as the engine's config reads them
    "serve_args": {"engine.config", "store.model_store"},
    "__init__": {"llm", "sampling_params"},
}


def _imports() -> dict[str, set[tuple[str, str]]]:
    """package -> {(imported module relative to tokenline, importing file)} across packages."""
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        package = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokenline"):
                if node.module == "tokenline":
                    names = [a.name for a in node.names]
                else:
                    names = [node.module.removeprefix("tokenline.")]
            elif isinstance(node, ast.Import):
                names = [a.name.removeprefix("tokenline.") for a in node.names if a.name.startswith("tokenline.")]
            else:
                continue
            for name in names:
                if name.split(".")[0] != package:
                    found[package].add((name, str(path.relative_to(ROOT))))
    return found


def _allowed(package: str, module: str) -> bool:
    return any(module == rule or module.startswith(rule + ".") for rule in ALLOWED.get(package, set()))


def test_packages_import_only_what_the_architecture_allows() -> None:
    wrong = sorted(
        f"{where} imports tokenline.{module}"
        for package, imports in _imports().items()
        for module, where in imports
        if not _allowed(package, module)
    )
    assert not wrong, "\n".join(wrong)


def test_no_import_loop_between_packages() -> None:
    graph = {p: {m.split(".")[0] for m, _ in imports} for p, imports in _imports().items()}
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in visiting, f"import loop: {' -> '.join([*path, node])}"
        if node in done:
            return
        visiting.add(node)
        for nxt in graph.get(node, ()):
            visit(nxt, [*path, node])
        visiting.discard(node)
        done.add(node)

    for package in graph:
        visit(package, [])


def test_the_api_process_and_a_router_never_load_torch() -> None:
    # The HTTP app, the gateway, the processor and block hashing run where no model does.
    code = (
        "import sys, tokenline.api.app, tokenline.gateway.gateway, tokenline.frontend.processor, "
        "tokenline.engine.client, tokenline.engine.block_pool; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_top_never_loads_torch() -> None:
    # `tokenline top` watches remote servers from any laptop: the command path stays light.
    code = "import sys, tokenline.cli, tokenline.top; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
