#!/usr/bin/env bash
# Build the Aliquot image without any container registry.
#
#  1. The base image, under our own name `aliquot/base:host` (never a public
#     name such as debian:bookworm-slim, which would shadow the real image
#     for everything else on this engine): unless present, make it — a rootfs
#     holding only what the binaries need (the shared libraries `ldd` names —
#     libc, libm, libgcc_s, the loader —, a shell for `docker exec`, /etc
#     basics), packed as a tar and `docker import`ed. Offline, a few seconds.
#  2. The service image, from binaries already compiled on this machine: they
#     are copied into a throwaway build context and the Dockerfile's
#     `prebuilt` target COPYs them.
#
# Usage: deploy/build-images.sh [--bin-dir DIR] [--tag IMAGE] [--base-only]
#                               [--force-base] [--base IMAGE]
#   --bin-dir DIR  take the binaries from DIR (default: `cargo build --release
#                  --bins`, then target/release)
#   --tag IMAGE    name of the service image (default aliquot:latest, which
#                  docker-compose.yml uses; env ALIQUOT_IMAGE)
#   --base-only    only make the base image
#   --force-base   remake the stand-in base even if the base name exists
#                  (never replaces an image that this script did not make)
#   --base IMAGE   build on IMAGE instead (e.g. debian:bookworm-slim when the
#                  engine has the real one); env ALIQUOT_BASE_IMAGE
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
dockerfile="$here/Dockerfile"
tag="${ALIQUOT_IMAGE:-aliquot:latest}"
bin_dir=""
base_only=0
force_base=0
base="${ALIQUOT_BASE_IMAGE:-aliquot/base:host}"

while [ $# -gt 0 ]; do
    case "$1" in
        --bin-dir) bin_dir="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --base-only) base_only=1; shift ;;
        --force-base) force_base=1; shift ;;
        --base) base="$2"; shift 2 ;;
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-images.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

say() { printf 'build-images: %s\n' "$*" >&2; }

command -v docker >/dev/null || { say "docker not found"; exit 1; }
docker info >/dev/null 2>&1 || { say "the docker engine is not reachable (docker info failed)"; exit 1; }


# Binaries the image holds; the first four are required.
required=(aliquot-allocator aliquot-agent aliquot-metrics aliquotctl)
optional=(aliquot-sim aliquot-otlp-sink)

if [ "$base_only" = 0 ] && [ -z "$bin_dir" ]; then
    say "cargo build --release --bins"
    (cd "$root" && cargo build --release --bins)
    bin_dir="$root/target/release"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/aliquot-images.XXXXXX")"
trap 'rm -rf "$work"' EXIT

bins=()
if [ "$base_only" = 0 ]; then
    for b in "${required[@]}"; do
        [ -x "$bin_dir/$b" ] || { say "missing $bin_dir/$b (build it first: cargo build --bins)"; exit 1; }
        bins+=("$bin_dir/$b")
    done
    for b in "${optional[@]}"; do
        if [ -x "$bin_dir/$b" ]; then bins+=("$bin_dir/$b"); fi
    done
fi

# ------------------------------------------------------------- base image --
ours_label="org.aliquot.base=host-libraries"
make_base=1
if docker image inspect "$base" >/dev/null 2>&1; then
    made_here="$(docker image inspect -f '{{ index .Config.Labels "org.aliquot.base" }}' "$base" 2>/dev/null || true)"
    if [ "$force_base" = 1 ] && [ "$made_here" = "host-libraries" ]; then
        say "remaking the stand-in $base"
    else
        make_base=0
        say "base $base already present${made_here:+ (stand-in made by this script)}"
    fi
fi

# Every library the binaries (and the shell) load, as ldd resolves them here.
libs_of() {
    ldd "$1" 2>/dev/null | awk '
        $2 == "=>" && $3 ~ /^\// { print $3 }
        $1 ~ /^\// { print $1 }'
}

if [ "$make_base" = 1 ]; then
    t0=$(date +%s%N)
    rootfs="$work/rootfs"
    mkdir -p "$rootfs"/{usr/bin,usr/sbin,usr/lib,usr/local/bin,etc,tmp,var/lib,root,proc,sys,dev,run}
    # merged-/usr layout, as on Debian bookworm
    ln -s usr/bin "$rootfs/bin"
    ln -s usr/sbin "$rootfs/sbin"
    ln -s usr/lib "$rootfs/lib"
    chmod 1777 "$rootfs/tmp"

    # A shell (dash as /bin/sh) for `docker exec … sh` and health checks
    # written as shell commands; nothing else of Debian's userland.
    shell="$(readlink -f /bin/sh)"
    cp -L "$shell" "$rootfs/usr/bin/dash"
    ln -sf dash "$rootfs/usr/bin/sh"

    # The binaries to come may not exist yet (--base-only): also take the
    # libraries any Rust binary of this toolchain links against.
    probe=("$shell")
    for b in "${bins[@]}"; do probe+=("$b"); done
    if [ "${#bins[@]}" = 0 ]; then
        for b in "${required[@]}"; do
            for d in "$root/target/release" "$root/target/debug"; do
                if [ -x "$d/$b" ]; then probe+=("$d/$b"); fi
            done
        done
    fi
    libs=()
    for p in "${probe[@]}"; do
        while IFS= read -r l; do libs+=("$l"); done < <(libs_of "$p")
    done
    # What Rust's std needs even when ldd saw no Rust binary.
    for l in libgcc_s.so.1 libm.so.6 libc.so.6; do
        # (no early `exit` in awk: ldconfig would die of SIGPIPE, fatal
        # under pipefail)
        f="$(ldconfig -p | awk -v n="$l" '!found && $1 == n && $NF ~ /^\// { print $NF; found = 1 }')"
        if [ -n "$f" ]; then libs+=("$f"); fi
    done
    for l in $(printf '%s\n' "${libs[@]}" | sort -u); do
        dest="$rootfs$l"
        mkdir -p "$(dirname "$dest")"
        # Into the rootfs under the path ldd printed (the loader's own path,
        # /lib64/ld-linux-x86-64.so.2, included), contents dereferenced.
        if [ ! -e "$dest" ]; then cp -L "$l" "$dest"; fi
        # and under the file's real name, which is what ld.so.cache would give
        real="$(readlink -f "$l")"
        if [ "$real" != "$l" ] && [ ! -e "$rootfs$real" ]; then
            mkdir -p "$(dirname "$rootfs$real")"
            cp -L "$l" "$rootfs$real"
        fi
    done

    cat >"$rootfs/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
aliquot:x:10001:10001:aliquot:/var/lib/aliquot:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
EOF
    cat >"$rootfs/etc/group" <<'EOF'
root:x:0:
aliquot:x:10001:
nogroup:x:65534:
EOF
    printf 'hosts: files dns\nnetworks: files\n' >"$rootfs/etc/nsswitch.conf"
    # docker bind-mounts /etc/hosts, /etc/resolv.conf and /etc/hostname.
    : >"$rootfs/etc/hosts"
    : >"$rootfs/etc/resolv.conf"
    : >"$rootfs/etc/hostname"
    if [ -r /etc/os-release ]; then cp /etc/os-release "$rootfs/etc/os-release"; fi
    # No /var/lib/aliquot here: the Dockerfile's COPY --chown makes it, and
    # the classic builder fails ("layer does not exist") on a COPY whose
    # layer would come out empty.

    tar --numeric-owner -C "$rootfs" -cf "$work/rootfs.tar" .
    docker import \
        --change "LABEL $ours_label" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/sh"]' \
        -m "aliquot stand-in base: host libraries only (deploy/build-images.sh)" \
        "$work/rootfs.tar" "$base" >/dev/null
    t1=$(date +%s%N)
    size="$(du -sh "$work/rootfs.tar" | cut -f1)"
    say "made $base from host libraries ($size, $(( (t1 - t0) / 1000000 )) ms): $(printf '%s\n' "${libs[@]}" | sort -u | xargs -n1 basename | tr '\n' ' ')"
fi

[ "$base_only" = 1 ] && exit 0

# ---------------------------------------------------------- service image --
ctx="$work/context"
mkdir -p "$ctx/bin" "$ctx/empty"
for b in "${bins[@]}"; do cp -L "$b" "$ctx/bin/"; done
cp "$dockerfile" "$ctx/Dockerfile"
say "docker build --target prebuilt -t $tag ($(ls "$ctx/bin" | tr '\n' ' '))"
# The classic builder (no buildx here) prints a deprecation notice: show the
# build's output only when it fails.
if ! docker build --target prebuilt --build-arg "RUNTIME_BASE=$base" -t "$tag" "$ctx" >"$work/build.log" 2>&1; then
    cat "$work/build.log" >&2
    say "docker build failed"
    exit 1
fi
# The image this tag had before is now untagged: drop such leftovers of our
# own builds (only images carrying this Dockerfile's title label).
docker image prune -f --filter "label=org.opencontainers.image.title=aliquot" >/dev/null 2>&1 || true
say "built $tag"
