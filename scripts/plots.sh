#!/usr/bin/env bash
# Draws the docs' figures from vmmdemo JSON results.
#
#   scripts/plots.sh RESULTS_DIR [FIGURES_DIR]
#
# Every RESULTS_DIR/NAME.json that `vmmdemo plot` knows (bandwidth, pinned, grow, broker, sleep; the
# kind is told by its keys) becomes FIGURES_DIR/NAME.svg (default docs/figures). Other JSON files are
# named and skipped. The docs expect these names, each the output of `vmmdemo SUB --json` on the GPU
# host:
#   bandwidth.json  vmmdemo bandwidth --backend cuda --json
#   pinned.json     vmmdemo pinned --backend cuda --size 16GiB --procs 4 --devices 0 --json
#   grow.json       vmmdemo grow --backend cuda --to 16GiB --step 256MiB --json
#   broker.json     vmmdemo broker --backend cuda --size 8GiB --workers 4 --json
#   sleep.json      vmmdemo sleep --backend cuda --size 16GiB --devices 0,1 --json
#   sleep-file.json vmmdemo sleep --backend cuda --size 16GiB --devices 0,1 --mode file --rounds 7 --json
# VMMDEMO names the vmmdemo binary to use; by default it is built from this checkout.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
results=$1
figures=${2:-docs/figures}
root=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$results" ] || { echo "plots.sh: $results is not a directory" >&2; exit 2; }
if [ -z "${VMMDEMO:-}" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$root" && ${GO:-go} build -o "$tmp/vmmdemo" ./cmd/vmmdemo)
  VMMDEMO=$tmp/vmmdemo
fi
mkdir -p "$figures"
drawn=0
shopt -s nullglob
for in in "$results"/*.json; do
  name=$(basename "$in" .json)
  if "$VMMDEMO" plot --in "$in" --out "$figures/$name.svg"; then
    drawn=$((drawn + 1))
  else
    echo "plots.sh: skipped $in (not a result vmmdemo plot draws)" >&2
  fi
done
echo "plots.sh: $drawn figure(s) in $figures"
[ "$drawn" -gt 0 ]
