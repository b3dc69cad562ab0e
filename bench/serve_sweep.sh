#!/usr/bin/env bash
# Start a tokenline server on the default model, run `tokenline bench serve` at concurrency 1, 8
# and 32 (input 256, output 128, fresh prompts per run), print one summary table, stop the server.
#   bench/serve_sweep.sh [extra `tokenline serve` flags...]
# Results (one JSON per run) land in bench-results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8123}
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
.venv/bin/tokenline serve --host 127.0.0.1 --port "$PORT" "$@" >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 0.5
done
run() {  # concurrency, prompts, seed
  .venv/bin/tokenline bench serve --base-url "http://127.0.0.1:$PORT" --concurrency "$1" --num-prompts "$2" \
    --input-len 256 --output-len 128 --seed "$3" --output-json "$OUT/serve-c$1.json" >"$OUT/serve-c$1.txt"
}
run 1 16 101
run 8 32 108
run 32 64 132
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'c':>3} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
for c in (1, 8, 32):
    r = json.loads((out / f"serve-c{c}.json").read_text())
    print(f"{c:>3} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} {r['p50_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>9.0f} "
          f"{r['p50_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} {r['p50_itl_ms']:>8.1f} {r['p99_itl_ms']:>8.1f}")
PY
