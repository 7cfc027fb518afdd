#!/usr/bin/env bash
# Builds the device plugin's container image, without a registry or a container engine, as an
# OCI archive: target/image/cuvisor-image.oci.tar (tag: the crates' version). docs/image.md says
# what is in it and how to publish it.
#
#     scripts/build-image.sh            # from target/shipped/ (scripts/build-shipped.sh)
#
# Distroless: the shipped binaries, exactly the shared libraries they need (resolved by this
# host's dynamic loader, copied at the paths it names, the loader included), the C library's
# small libraries a driver's libnvidia-ml.so.1 links against, /etc/passwd and /etc/group, and
# the loader's configuration (/etc/ld.so.conf.d) the NVIDIA container toolkit's ldcache hook
# expects. No shell, no package manager.
#
# Reproducible: every file's time is SOURCE_DATE_EPOCH (default: the last commit's time), as
# are the image's creation and history dates, and the archive is written in name order with
# fixed owners: the same inputs give the same bytes.
#
# Needs umoci (Debian's package; installed with apt-get when missing and running as root) and
# binutils (readelf, strip).
set -euo pipefail
cd "$(dirname "$0")/.."

shipped=target/shipped
out_dir=target/image
out=$out_dir/cuvisor-image.oci.tar
say() { echo "build-image: $*" >&2; }

for f in libcuvisor.so cuvisor-device-plugin cuvisor; do
  if [ ! -f "$shipped/$f" ]; then
    say "$shipped/$f is missing: build the shipped artefacts first (scripts/build-shipped.sh)"
    exit 1
  fi
done

if ! command -v umoci >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing umoci"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends umoci >/dev/null
  else
    say "umoci is missing: apt-get install umoci"
    exit 1
  fi
fi

version=$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[ -n "$version" ] || { say "no version in Cargo.toml's [workspace.package]"; exit 1; }
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
source_url=https://github.com/cuvisor/cuvisor

mkdir -p "$out_dir"
work=$(mktemp -d "$out_dir/work.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"

# Copies the host's absolute path $1 into $root at the same path: every symbolic link met on
# the way is made again (with its own target) and followed, so that the paths the loader names
# (/lib64/ld-linux-x86-64.so.2 -> ...) resolve in the image as on this host. Nothing is ever
# written through a link inside $root: $cur is always a path without links.
copy_path() {
  local cur="" comp cand target
  local -a parts
  IFS=/ read -ra parts <<<"${1#/}"
  for comp in "${parts[@]}"; do
    [ -n "$comp" ] || continue
    cand="$cur/$comp"
    if [ -L "$cand" ]; then
      target=$(readlink "$cand")
      [ -L "$root$cand" ] || ln -s "$target" "$root$cand"
      case $target in
        /*) copy_path "$target" ;;
        *) copy_path "$cur/$target" ;;
      esac
      cur=$(realpath "$cand")
    elif [ -d "$cand" ]; then
      mkdir -p "$root$cand"
      cur=$cand
    elif [ -f "$cand" ]; then
      [ -e "$root$cand" ] || cp "$cand" "$root$cand"
      cur=$cand
    else
      say "$1: $cand does not exist on this host"
      exit 1
    fi
  done
}

# The shared libraries the dynamic loader resolves for $1 (their paths as it names them), and
# the loader itself (the ELF interpreter).
needed() {
  local interp
  interp=$(readelf -l "$1" | sed -n 's/.*\[Requesting program interpreter: \(.*\)\]/\1/p')
  [ -n "$interp" ] || interp=/lib64/ld-linux-x86-64.so.2
  echo "$interp"
  local list
  list=$("$interp" --list "$1") || { say "$1: the loader cannot list its libraries"; exit 1; }
  if grep -q 'not found' <<<"$list"; then
    say "$1: a library it needs is not on this host:"$'\n'"$list"
    exit 1
  fi
  awk '$2 == "=>" && $3 ~ /^\// { print $3 }' <<<"$list"
}

# Without their debug information (the release profile keeps line tables: 44 MB of the
# plugin's 50): symbols stay, so backtraces still name functions. target/shipped/ keeps it all.
put() {
  mkdir -p "$(dirname "$root$2")"
  strip --strip-debug -o "$root$2" "$shipped/$1"
  chmod 0755 "$root$2"
}
put cuvisor-device-plugin /usr/local/bin/cuvisor-device-plugin
put cuvisor /usr/local/bin/cuvisor
# Copied to the host by the plugin itself ([host] install_from), never loaded in this image.
put libcuvisor.so /usr/local/lib/cuvisor/libcuvisor.so

libs=()
for bin in cuvisor-device-plugin cuvisor; do
  found=$(needed "$shipped/$bin") # not in a pipe: its failure stops the script
  mapfile -t -O "${#libs[@]}" libs <<<"$found"
done
# The NVIDIA container toolkit mounts the driver's libnvidia-ml.so.1 (utility capability) but
# no C library: the image must hold what that library links against. Driver libraries are
# built for old C libraries, where dlopen and threads lived in libdl and libpthread (stubs in
# glibc 2.34 and later, still needed as files); libm and librt with them. And libgcc_s.so.1
# whatever the binaries link (a zig-linked plugin does not): glibc loads it itself to unwind
# in pthread_cancel and pthread_exit, and a library built with gcc may need it (the simulated
# NVML does; tests/image.rs failed without it).
libc_dir=$(dirname "$(printf '%s\n' "${libs[@]}" | grep '/libc\.so\.6$' | head -n1)")
for l in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libgcc_s.so.1; do
  if [ -e "$libc_dir/$l" ]; then
    libs+=("$libc_dir/$l")
  else
    say "$libc_dir/$l is missing on this host"
    exit 1
  fi
done
mapfile -t libs < <(printf '%s\n' "${libs[@]}" | sort -u)
for l in "${libs[@]}"; do
  copy_path "$l"
done

mkdir -p "$root/etc/cuvisor" "$root/etc/ld.so.conf.d" "$root/tmp"
chmod 1777 "$root/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
# The toolkit's update-ldcache hook runs the host's ldconfig on this root to add the driver's
# directories; /etc/ld.so.conf.d must exist, and listing the image's own library directories
# keeps the C library found through the cache it writes (NVIDIA/nvidia-container-toolkit#1326,
# NVIDIA/k8s-device-plugin#1182).
printf 'include /etc/ld.so.conf.d/*.conf\n' >"$root/etc/ld.so.conf"
printf '%s\n' "${libs[@]}" | xargs -n1 dirname | sort -u | while read -r d; do
  realpath "$d"
done | sort -u >"$root/etc/ld.so.conf.d/cuvisor-image.conf"

chown -R 0:0 "$root"
find "$root" -exec touch -h -d "@$epoch" {} +

say "rootfs: $(find "$root" -type f | wc -l) files, $(du -sk "$root" | cut -f1) KiB"
for l in "${libs[@]}"; do say "  library $l"; done

oci=$work/oci
ref="$oci:$version"
umoci init --layout "$oci"
umoci new --image "$ref"
# One layer: the empty image unpacked, the tree copied in, repacked (umoci 0.4.7's `insert` of a
# tree at / writes a layer tar that GNU tar cannot read to its end).
bundle=$work/bundle
rootless=()
[ "$(id -u)" = 0 ] || rootless=(--rootless)
umoci unpack "${rootless[@]}" --image "$ref" "$bundle"
cp -a "$root/." "$bundle/rootfs/"
find "$bundle/rootfs" -exec touch -h -d "@$epoch" {} +
umoci repack --image "$ref" --history.created "$created" \
  --history.created_by "scripts/build-image.sh" "$bundle"
umoci config --image "$ref" --created "$created" --history.created "$created" \
  --history.created_by "scripts/build-image.sh" \
  --os linux --architecture amd64 --config.user 0:0 --config.workingdir / \
  --config.entrypoint /usr/local/bin/cuvisor-device-plugin \
  --config.entrypoint=--config --config.entrypoint /etc/cuvisor/config.toml \
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env NVIDIA_VISIBLE_DEVICES=all \
  --config.env NVIDIA_DRIVER_CAPABILITIES=compute,utility \
  --config.label "org.opencontainers.image.title=cuvisor-device-plugin" \
  --config.label "org.opencontainers.image.description=cuvisor's Kubernetes device plugin and libcuvisor.so" \
  --config.label "org.opencontainers.image.source=$source_url" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.revision=$revision" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --config.label "org.opencontainers.image.created=$created" \
  --manifest.annotation "org.opencontainers.image.source=$source_url" \
  --manifest.annotation "org.opencontainers.image.version=$version" \
  --manifest.annotation "org.opencontainers.image.revision=$revision" \
  --manifest.annotation "org.opencontainers.image.licenses=Apache-2.0" \
  --manifest.annotation "org.opencontainers.image.created=$created"
umoci gc --layout "$oci"

# An OCI archive (skopeo's oci-archive:, podman load) is a tar of the layout directory.
tmp_out=$out.tmp
find "$oci" -exec touch -h -d "@$epoch" {} +
tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner \
  --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -C "$oci" -cf "$tmp_out" .
mv -f "$tmp_out" "$out"
say "$out: $(du -k "$out" | cut -f1) KiB, tag $version, $(sha256sum "$out" | cut -c1-16)…"
