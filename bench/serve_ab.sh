#!/usr/bin/env bash
# A server benchmark of two commits side by side: one default server at a time, alternating
# (A B A B), `tokenline bench serve` at c=1 (8 prompts) and c=8 (32 prompts), 256 in / 64 out.
# Each commit is checked out under OUTDIR (a git worktree, removed at the end).
# usage: bench/serve_ab.sh OLD_REV NEW_REV OUTDIR   (from the repository root, after `make install`)
# environment: SERVE_ARGS (e.g. "-q q8_0", given to both servers), CONCURRENCIES (default "1 8"; 4C
# prompts each, 8 at c=1), PY (default .venv/bin/python), PORT (default 8765), ROUNDS (default 2)
set -u
OLD=$1; NEW=$2; OUT=$(realpath -m "$3"); mkdir -p "$OUT"
REPO=$(pwd)
PY=${PY:-$REPO/.venv/bin/python}
SERVE_ARGS=${SERVE_ARGS:-}
CONCURRENCIES=${CONCURRENCIES:-1 8}
PORT=${PORT:-8765}
ROUNDS=${ROUNDS:-2}
for rev in $OLD $NEW; do rm -rf "$OUT"/tree_$rev; git -C "$REPO" worktree add -q -f --detach "$OUT"/tree_$rev $rev; done
for round in $(seq $ROUNDS); do for rev in $OLD $NEW; do
  cd "$OUT"/tree_$rev
  PYTHONPATH="$OUT"/tree_$rev $PY -m tokenline.cli serve --host 127.0.0.1 --port $PORT $SERVE_ARGS > "$OUT"/server_${rev}_$round.log 2>&1 &
  pid=$!
  for i in $(seq 180); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  for c in $CONCURRENCIES; do
    PYTHONPATH="$OUT"/tree_$rev timeout 400 $PY -m tokenline.cli bench serve --base-url http://127.0.0.1:$PORT --concurrency $c --num-prompts $((c==1?8:4*c)) --input-len 256 --output-len 64 --output-json "$OUT"/${rev}_c${c}_r$round.json > "$OUT"/${rev}_c${c}_r$round.txt 2>&1
  done
  kill $pid; wait $pid 2>/dev/null
done; done
for rev in $OLD $NEW; do git -C "$REPO" worktree remove --force "$OUT"/tree_$rev; done
