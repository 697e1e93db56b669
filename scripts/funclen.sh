#!/bin/sh
# funclen.sh prints the five longest functions of measure/ and cmd/vmmdemo/ and fails when one is
# over the limit (100 lines in measure, 80 in cmd/vmmdemo).
set -e
cd "$(dirname "$0")/.."
exec "${GO:-go}" test -count=1 -run '^TestFunctionLength$' -v ./measure
