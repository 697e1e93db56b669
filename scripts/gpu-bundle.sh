#!/usr/bin/env bash
# Builds every package's test binary, vmmdemo and run.sh into the bundle directory, for a GPU host
# that has the driver but no Go toolchain. Test binaries travel xz-compressed (the bundle must stay small);
# run.sh unpacks them on the GPU host. The bundle is run from a copy of this source tree:
#   build/gpu/run.sh        # every test binary with CUVMM_REQUIRE_GPU=1, ends "N passed, N failed"
set -euo pipefail
out=${1:-build/gpu}
GO=${GO:-go}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
rm -rf "$out"
mkdir -p "$out/bin"
module=$($GO list -m)
pkgs=()
for pkg in $($GO list ./...); do
  dir=${pkg#"$module"}
  dir=${dir#/}
  [ -n "$dir" ] || dir=.
  # BUNDLE_PACKAGES="vmm growbuf" limits the bundle to those package directories.
  if [ -n "${BUNDLE_PACKAGES:-}" ] && [[ " $BUNDLE_PACKAGES " != *" $dir "* ]]; then
    continue
  fi
  if ls "$dir"/*_test.go >/dev/null 2>&1; then
    name=$(echo "$dir" | tr '/' '_')
    $GO test -c -trimpath -ldflags="-s -w" -o "$out/bin/$name.test" "./$dir"
    xz -T0 "$out/bin/$name.test"
    pkgs+=("$dir:$name")
  fi
done
$GO build -trimpath -ldflags="-s -w" -o "$out/bin/vmmdemo" ./cmd/vmmdemo
xz -T0 "$out/bin/vmmdemo"
# build/gpu/vmmdemo unpacks the command once per bundle into a temporary directory and runs it.
sum=$(sha256sum "$out/bin/vmmdemo.xz" | cut -c1-16)
sed "s/@SUM@/$sum/" scripts/vmmdemo.sh.in >"$out/vmmdemo"
chmod +x "$out/vmmdemo"
{
  sed -n '1,/^# PACKAGES$/p' scripts/run.sh.in
  echo "packages=("
  for p in "${pkgs[@]}"; do echo "  \"$p\""; done
  echo ")"
  sed -n '/^# PACKAGES$/,$p' scripts/run.sh.in | tail -n +2
} >"$out/run.sh"
chmod +x "$out/run.sh"
echo "bundle: ${#pkgs[@]} test binaries, vmmdemo and run.sh in $out"
