#!/usr/bin/env bash
# Wall seconds of three successive short `specmlx run`s from a fresh $SPECMLX_HOME (the first
# probes the target; what the second and third pay is the question: issue 65, a later probe on a
# short run), an earlier revision against this checkout, trials alternating.
#   experiments/short_runs.sh REV   (TARGET=smollm2-135m DRAFT=lookup N=40 TRIALS=2)
# Prints per trial and checkout each run's seconds, decode tok/s and auto's "from".
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
REV=${1:?usage: experiments/short_runs.sh REV}
HERE=$(pwd)
BEFORE=$(mktemp -d)
git worktree add -q --detach "$BEFORE" "$REV"
trap 'git worktree remove --force "$BEFORE"' EXIT
for trial in $(seq "${TRIALS:-2}"); do
  for tree in "$BEFORE" "$HERE"; do
    home=$(mktemp -d)
    line="$([ "$tree" = "$HERE" ] && echo here || echo "$REV") trial $trial:"
    for run in 1 2 3; do
      t0=$(date +%s.%N)
      (cd /tmp && SPECMLX_HOME=$home PYTHONPATH=$tree "$HERE/.venv/bin/python" -m specmlx run \
        --target "${TARGET:-smollm2-135m}" --draft "${DRAFT:-lookup}" -n "${N:-40}" --json \
        "def parse(line):" > "$home/out.json" 2>/dev/null)
      t1=$(date +%s.%N)
      got=$("$HERE/.venv/bin/python" -c "import json, sys; s = json.load(open(sys.argv[1]))['stats']
print(round(s['decode_tps'], 1), 'tok/s,', s['auto']['from'])" "$home/out.json")
      line="$line  run $run $(python3 -c "print(round($t1 - $t0, 2))") s ($got)"
    done
    echo "$line"
    rm -rf "$home"
  done
done
