#!/usr/bin/env bash
# Builds what cuvisor ships — libcuvisor.so, cuvisor-device-plugin and cuvisor — as release
# builds that need nothing newer than glibc 2.17, into target/shipped/.
#
# Why glibc 2.17: libcuvisor.so is preloaded into every process of a tenant's container, whose
# image brings its own glibc (CUDA's base images: UBI 8 / Rocky 8 = 2.28, Ubuntu 20.04 = 2.31,
# CentOS 7 = 2.17). A library built on this machine (glibc 2.36) asks for GLIBC_2.33/2.34
# symbol versions and fails to load there. docs/glibc.md says more, and how the floor is checked.
#
# Why zig (cargo-zigbuild, target x86_64-unknown-linux-gnu.2.17) rather than
#  - an old sysroot (a CentOS 7 / manylinux2014 build image, or an old Debian's libc6-dev): no
#    such image or release is reachable from here or from CI (only the Rust and Python package
#    registries and Debian's current releases); zig ships, inside a PyPI wheel, link stubs of
#    every glibc version from 2.17 on, so the link itself binds each symbol to the oldest
#    version that has it;
#  - avoiding new symbol versions by hand (`.symver` directives, a version script, calling
#    old names): that has to be redone for every symbol std, the libc crate or a dependency
#    adds, and nothing checks it while linking. With zig a symbol that 2.17 lacks is a link
#    error (that is how our own getrandom(3) call was found: crates/shm now calls the system
#    call), and tests/shipped_glibc.rs checks the result independently.
# The Rust target stays the host's (x86_64-unknown-linux-gnu, no other std to download): Rust's
# own std supports glibc 2.17 and resolves newer functions (statx, getrandom, gettid) weakly.
#
# Tools: ziglang and cargo-zigbuild from PyPI, pinned, installed once into target/ci-tools/
# (git-ignored), as .ci/run does kubernetes-validate.
# Time: 207 s from nothing on 2 shared cores (the pip install and the release build of the three
# binaries; a machine whose zig cache is empty adds about 25 s for the glibc 2.17 stubs),
# seconds when target/x86_64-unknown-linux-gnu/ is already built.
set -euo pipefail
cd "$(dirname "$0")/.."

ZIGLANG_VERSION=0.17.1
CARGO_ZIGBUILD_VERSION=0.24.1
TARGET=x86_64-unknown-linux-gnu.2.17

venv=target/ci-tools/zigbuild
stamp="$venv/.versions"
want="ziglang==$ZIGLANG_VERSION cargo-zigbuild==$CARGO_ZIGBUILD_VERSION"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "== installing $want into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "ziglang==$ZIGLANG_VERSION" \
    "cargo-zigbuild==$CARGO_ZIGBUILD_VERSION"
  echo "$want" >"$stamp"
fi
# cargo-zigbuild finds zig as `python3 -m ziglang`: the venv's python3, first on PATH.
export PATH="$PWD/$venv/bin:$PATH"

echo "== cargo zigbuild --release --target $TARGET (libcuvisor.so, cuvisor-device-plugin, cuvisor)"
cargo zigbuild --release --locked --target "$TARGET" \
  -p cuvisor -p cuvisor-device-plugin -p cuvisor-cli

out=target/x86_64-unknown-linux-gnu/release
mkdir -p target/shipped
for f in libcuvisor.so cuvisor-device-plugin cuvisor; do
  # Copy then rename: a reader of target/shipped/ never sees half a file.
  cp "$out/$f" "target/shipped/.$f.tmp"
  mv -f "target/shipped/.$f.tmp" "target/shipped/$f"
done
ls -l target/shipped/
