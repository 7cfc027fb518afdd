#!/usr/bin/env bash
# Runs the shipped cuvisor and libcuvisor.so (target/shipped/, scripts/build-shipped.sh) in an
# older glibc's userland, as a tenant image would: a Debian release's minimal root file system
# (debootstrap, default: bullseye, glibc 2.31 = Ubuntu 20.04's), in runc, as uid 1000, on the
# simulated GPU (its libraries built for glibc 2.17 too). Checks that
#  1. the tf_stress twin, compiled in that userland with its own gcc, runs under
#     `cuvisor run --sim single --memory 6Gi` with the library preloaded: it sees a 6 GiB GPU
#     and gets a clean out-of-memory for 1.2 of it ("twin: PASS", one refusal line);
#  2. a library built on this machine (target/debug/deps/libcuvisor.so, when it needs a newer
#     glibc than the userland's) is refused by `cuvisor run` with one line naming both glibcs.
# Needs root, runc, debootstrap (installed from Debian's packages when missing) and the network
# for the first run (the root file system is kept in target/ci-tools/rootfs-SUITE). Not part of
# .ci/run (a minute of debootstrap and a second release build); docs/glibc.md.
set -euo pipefail
cd "$(dirname "$0")/.."
suite="${1:-bullseye}"

[ -x target/shipped/libcuvisor.so ] || { echo "target/shipped/ is empty: run scripts/build-shipped.sh" >&2; exit 1; }
command -v runc >/dev/null || { echo "runc is needed" >&2; exit 1; }
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

rootfs="$PWD/target/ci-tools/rootfs-$suite"
if [ ! -x "$rootfs/usr/bin/gcc" ]; then
  echo "== debootstrap $suite (minbase, gcc) into $rootfs"
  rm -rf "$rootfs.tmp"
  debootstrap --variant=minbase --include=gcc,libc6-dev "$suite" "$rootfs.tmp" >/dev/null
  rm -rf "$rootfs" && mv "$rootfs.tmp" "$rootfs"
fi
glibc=$(chroot "$rootfs" ldd --version | sed -n '1s/.* //p')
echo "== $suite: glibc $glibc"

echo "== the simulated GPU's libraries, for glibc 2.17"
export PATH="$PWD/target/ci-tools/zigbuild/bin:$PATH"
cargo zigbuild -q --release --locked --target x86_64-unknown-linux-gnu.2.17 \
  -p cuvisor-sim-cuda -p cuvisor-sim-nvml

work=$(mktemp -d)
trap 'rm -rf "$work"; runc delete -f "cuvisor-glibc-$$" >/dev/null 2>&1 || true' EXIT
stage="$work/opt"
mkdir -p "$stage/sim"
cp target/shipped/cuvisor target/shipped/libcuvisor.so "$stage/"
cp target/x86_64-unknown-linux-gnu/release/libcuvisor_sim_cuda.so "$stage/sim/libcuda.so.1"
cp target/x86_64-unknown-linux-gnu/release/libcuvisor_sim_nvml.so "$stage/sim/libnvidia-ml.so.1"
ln -s libcuda.so.1 "$stage/sim/libcuda.so"
ln -s libnvidia-ml.so.1 "$stage/sim/libnvidia-ml.so"
[ -f target/debug/deps/libcuvisor.so ] && cp target/debug/deps/libcuvisor.so "$stage/host-built.so"
# The twin, compiled by the userland's own gcc against its own glibc.
mkdir -p "$rootfs/opt/test" "$rootfs/opt/cuvisor"
cp examples/tf_stress/twin.c "$rootfs/opt/test/twin.c"
chroot "$rootfs" gcc -O1 -Wall -Werror -o /opt/test/twin /opt/test/twin.c -ldl

# One container: argv as given, the staged files at /opt/cuvisor (read-only), uid 1000.
run_in() {
  local bundle="$work/bundle"
  rm -rf "$bundle" && mkdir -p "$bundle"
  (cd "$bundle" && runc spec)
  python3 - "$bundle/config.json" "$rootfs" "$stage" "$@" <<'EOF'
import json, sys
path, rootfs, stage, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
c = json.load(open(path))
c["root"] = {"path": rootfs, "readonly": True}
c["process"]["terminal"] = False
c["process"]["args"] = args
c["process"]["user"] = {"uid": 1000, "gid": 1000}
c["process"]["env"] = ["PATH=/usr/local/bin:/usr/bin:/bin", "TMPDIR=/tmp"]
c["mounts"].append({"destination": "/opt/cuvisor", "type": "bind", "source": stage,
                    "options": ["rbind", "ro"]})
c["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                    "options": ["nosuid", "nodev", "mode=1777"]})
json.dump(c, open(path, "w"))
EOF
  runc run -b "$bundle" "cuvisor-glibc-$$" </dev/null
}

echo "== 1. the twin under cuvisor run --sim single --memory 6Gi, in $suite (glibc $glibc)"
set +e
out=$(run_in /opt/cuvisor/cuvisor run --sim single --memory 6Gi -- /opt/test/twin 2>&1)
rc=$?
set -e
echo "$out"
[ "$rc" = 0 ] && grep -q "^twin: PASS" <<<"$out" && grep -q "^cuvisor: cuMemAlloc_v2 of .* refused" <<<"$out" \
  || { echo "FAIL: the shipped library did not hold the twin to its quota in $suite" >&2; exit 1; }

if [ -f "$stage/host-built.so" ]; then
  echo "== 2. the library built on this machine, in $suite"
  set +e
  out=$(run_in /opt/cuvisor/cuvisor run --sim single --memory 6Gi --library /opt/cuvisor/host-built.so -- /opt/test/twin 2>&1)
  rc=$?
  set -e
  echo "$out (exit $rc)"
  if grep -q "needs glibc .*; the command's libc is glibc $glibc\$" <<<"$out"; then
    [ "$rc" = 2 ] || { echo "FAIL: refused with exit $rc, not 2" >&2; exit 1; }
  elif [ "$rc" = 0 ]; then
    echo "(this machine's build needs nothing newer than glibc $glibc: nothing to refuse)"
  else
    echo "FAIL: unexpected answer" >&2; exit 1
  fi
fi
echo "OK: the shipped library works in $suite (glibc $glibc)"
