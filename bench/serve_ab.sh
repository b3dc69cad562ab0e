#!/usr/bin/env bash
# A server benchmark of two commits side by side: one default server at a time, alternating
# (A B A B), `tokenline bench serve` at c=1 (8 prompts) and c=8 (32 prompts), 256 in / 64 out.
# usage: bench/serve_ab.sh OLD_REV NEW_REV OUTDIR   (from the repository root, after `make install`)
set -u
OLD=$1; NEW=$2; OUT=$(realpath -m "$3"); mkdir -p "$OUT"
REPO=$(pwd)
PY=$REPO/.venv/bin/python
for rev in $OLD $NEW; do rm -rf /tmp/ab_$rev; git -C "$REPO" worktree add -q -f --detach /tmp/ab_$rev $rev; done
for round in 1 2; do for rev in $OLD $NEW; do
  cd /tmp/ab_$rev
  PYTHONPATH=/tmp/ab_$rev $PY -m tokenline.cli serve --host 127.0.0.1 --port 8765 > "$OUT"/server_${rev}_$round.log 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 1; done
  for c in 1 8; do
    PYTHONPATH=/tmp/ab_$rev timeout 300 $PY -m tokenline.cli bench serve --base-url http://127.0.0.1:8765 --concurrency $c --num-prompts $((c==1?8:32)) --input-len 256 --output-len 64 --output-json "$OUT"/${rev}_c${c}_r$round.json > "$OUT"/${rev}_c${c}_r$round.txt 2>&1
  done
  kill $pid; wait $pid 2>/dev/null
done; done
for rev in $OLD $NEW; do git -C "$REPO" worktree remove --force /tmp/ab_$rev; done
