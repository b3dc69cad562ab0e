"""The package rules of ARCHITECTURE.md, checked on the code: who may import whom, the order of the
packages, no import loop between files, and the processes that must never load torch.

The import graphs are read from every ``import`` statement in the source (``ast``), wherever it
stands: at module level, inside a function (a lazy import still ties the two files together) and
under ``if TYPE_CHECKING:`` (a type named across a loop is a loop for a reader). The only imports
they cannot see are ``importlib.import_module`` calls: the model registry's lazy load of one model
module by name, which points down the tree.
"""

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
    "store": set(),  # where models live: read by the API process and the gateway, so no model code
    "spec_decode": set(),  # proposers see token ids only
    "model": {"sampling_params", "store"},
    # validating a constraint in the API process, masks in the engine; measures a compile's memory
    "structured_output": {"model.host_memory", "sampling_params"},
    "engine": {"model", "sampling_params", "setting_field", "spec_decode", "structured_output"},
    # the one context check (engine.context_window) is shared with the engine's guard
    "frontend": {"engine.context_window", "engine.messages", "structured_output", "sampling_params"},
    "gateway": {"engine.messages", "store.model_store"},
    "api": {"gateway", "frontend", "engine", "model.config", "store.model_store", "router", "sampling_params",
            "settings.server", "__version__"},
    # routing policies and fleet clients: engine records and clients, never a model
    "router": {"engine", "sampling_params"},
    "llm": {"frontend", "engine", "store.model_store", "sampling_params"},
    # bench serve reads /metrics deltas with top's helpers (top imports no tokenline code)
    "bench": {"engine", "frontend", "llm", "model", "sampling_params", "store", "top"},
    "cli": {"api", "bench", "engine", "frontend", "gateway", "llm", "model", "router", "sampling_params",
            "settings", "setting_field", "sim", "store", "top", "trace_walk"},
    # `tokenline simulate` / `bench calibrate`: the real scheduler and KV books on a simulated clock,
    # reported in bench serve's shape; calibrate measures the machine with bench's machine probes and
    # watches the neighbours' CPU
    "sim": {"bench.machine_probes", "bench.multiturn", "bench.neighbour_cpu", "bench.ports", "bench.prompts",
            "bench.results", "bench.serve", "engine", "model", "router", "sampling_params"},
    "top": set(),  # `tokenline top` reads any server's /metrics over HTTP: no tokenline code
    "trace_walk": {"engine", "frontend", "gateway.ledger", "llm", "model", "sampling_params"},
    # every setting declared once (setting_field, a leaf) on the records that own it; the parsers,
    # --config files and the reference are made from them
    "setting_field": set(),
    "settings": {"engine.client", "engine.config", "frontend.chat_template", "frontend.reasoning",
                 "frontend.tool_parsers", "gateway.cache_scope", "store.model_store", "router.ray_serve",  # a type
                 "setting_field"},
    "__init__": {"llm", "sampling_params"},
}

# The packages from the bottom up: each may import only packages before it, so no import points up
# and no two packages import each other. The API side (router … api) sits above the engine records
# it reads; the tools that drive a whole server or engine sit on top.
ORDER: list[str] = [
    "sampling_params", "setting_field", "store", "spec_decode", "model", "structured_output", "engine", "router",
    "frontend", "gateway", "settings", "top", "api", "llm", "trace_walk", "bench", "sim", "cli", "__init__",
]

# The packages of the API process and of a router, which run where no model does: every module of
# them imports without torch. Leaves out the modules that are the exception on purpose.
TORCH_FREE = ["api", "frontend", "gateway", "router", "settings", "setting_field", "spec_decode", "store",
              "structured_output",
              "sampling_params", "engine.block_pool", "engine.client", "engine.config", "engine.messages",
              "engine.process_client"]
LOADS_TORCH_ON_PURPOSE = {
    "store.gguf_import",  # converts a GGUF file's weights; imported only when a model is imported
    "router.ray_serve",  # Ray Serve's replicas hold engines; only `serve --ray` imports it
}


def _module_names() -> dict[str, Path]:
    """Every module of the package, by dotted name relative to tokenline ("" for tokenline itself)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imported(path: Path, name: str) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for each tokenline import in a file, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["tokenline", *package.split(".")] if package else ["tokenline"]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module == "tokenline" or module.startswith("tokenline."):
                found.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name == "tokenline" or a.name.startswith("tokenline.")]
    return found


def _file_graph() -> dict[str, set[str]]:
    """module -> the tokenline modules it imports (``from pkg import mod`` counts as importing mod)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for module, names in _imported(path, name):
            relative = module.removeprefix("tokenline").removeprefix(".")
            for imported in names or [""]:
                submodule = f"{relative}.{imported}".strip(".")
                if submodule in modules:
                    targets.add(submodule)
                    continue
                while relative not in modules:
                    relative = relative.rpartition(".")[0]
                targets.add(relative)
        graph[name] = targets - {name}
    return graph


def _imports() -> dict[str, set[tuple[str, str]]]:
    """package -> {(imported module relative to tokenline, importing file)} across packages."""
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for name, path in _module_names().items():
        package = name.split(".")[0] or "__init__"
        for module, names in _imported(path, name):
            imported = names if module == "tokenline" else [module.removeprefix("tokenline.")]
            for target in imported:
                if target.split(".")[0] != package:
                    found[package].add((target, str(path.relative_to(ROOT))))
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


def test_every_package_has_its_place_in_the_order() -> None:
    packages = {name.split(".")[0] or "__init__" for name in _module_names()}
    assert packages == set(ORDER) == set(ALLOWED), (packages ^ set(ORDER)) | (packages ^ set(ALLOWED))


def test_no_import_points_up_the_package_order() -> None:
    rank = {package: i for i, package in enumerate(ORDER)}
    upward = sorted(
        f"{where} imports tokenline.{module}"
        for package, imports in _imports().items()
        for module, where in imports
        # the version string is a constant of the root package, set before it imports anything
        if module != "__version__" and rank[module.split(".")[0]] > rank[package]
    )
    assert not upward, "\n".join(upward)


def test_no_import_loop_between_files() -> None:
    graph = _file_graph()
    visiting: list[str] = []
    done: set[str] = set()
    loops: list[str] = []

    def visit(node: str) -> None:
        if node in done:
            return
        if node in visiting:
            loops.append(" -> ".join([*visiting[visiting.index(node):], node]))
            return
        visiting.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        visiting.pop()
        done.add(node)

    for module in sorted(graph):
        visit(module)
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_the_file_graph_sees_lazy_and_type_only_imports() -> None:
    # The rules above are only as good as the graph: a function-level import and one under
    # TYPE_CHECKING must both count.
    graph = _file_graph()
    assert "engine.engine_core" in graph["engine.factory"]  # imported inside build_engine_core
    assert "store.gguf_import" in graph["store.model_store"]  # imported inside _import_once
    assert "model.interface" in graph["model.weights"]  # imported under TYPE_CHECKING


def test_the_api_side_packages_never_load_torch() -> None:
    # The HTTP app, the gateway, the processor, the routers and block hashing run where no model
    # does: every module of their packages imports without torch.
    modules = sorted(
        f"tokenline.{name}" for name in _module_names()
        if any(name == p or name.startswith(p + ".") for p in TORCH_FREE) and name not in LOADS_TORCH_ON_PURPOSE
    )
    assert "tokenline.api.app" in modules and "tokenline.structured_output.grammar" in modules
    code = (
        f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_top_never_loads_torch() -> None:
    # `tokenline top` watches remote servers from any laptop: the command path stays light.
    code = "import sys, tokenline.cli, tokenline.top; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
