#!/usr/bin/env bash
# Build a PostgreSQL server image without any container registry, for the
# high-availability deployment (deploy/docker-compose.ha.yml).
#
# The image holds this machine's own PostgreSQL server, as Debian's
# `postgresql` package installed it (/usr/lib/postgresql/<major>), with its
# share files, the time zone database and exactly the shared libraries `ldd`
# names, plus dash and a small entrypoint; packed as a tar and
# `docker import`ed. Offline, a few seconds. It runs as the unprivileged
# user `postgres` (uid 999); its data directory /var/lib/postgresql/data
# belongs to that user, so a fresh named volume mounted there does too.
#
# The entrypoint initialises an empty data directory (`initdb`, UTF-8, C
# locale, SCRAM passwords: user `aliquot`, database `aliquot`, password from
# $POSTGRES_PASSWORD, required) and runs the server listening on every
# address of the container, password-authenticated from anywhere but the
# container itself. Durability is PostgreSQL's default (fsync on, synchronous
# commit): the allocator acknowledges a synced txg only once it is committed.
#
# Usage: deploy/build-postgres-image.sh [--tag IMAGE] [--pg-dir DIR]
#   --tag IMAGE   default aliquot/postgres:host (env ALIQUOT_POSTGRES_IMAGE)
#   --pg-dir DIR  the server installation (default: the newest
#                 /usr/lib/postgresql/<major>; install it with
#                 `apt-get install postgresql`, as .ci/run does)
set -euo pipefail

tag="${ALIQUOT_POSTGRES_IMAGE:-aliquot/postgres:host}"
pg_dir=""
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag="$2"; shift 2 ;;
        --pg-dir) pg_dir="$2"; shift 2 ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-postgres-image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

say() { printf 'build-postgres-image: %s\n' "$*" >&2; }

command -v docker >/dev/null || { say "docker not found"; exit 1; }
docker info >/dev/null 2>&1 || { say "the docker engine is not reachable (docker info failed)"; exit 1; }

if [ -z "$pg_dir" ]; then
    pg_dir="$(ls -d /usr/lib/postgresql/*/ 2>/dev/null | sort -V | tail -1 || true)"
    pg_dir="${pg_dir%/}"
fi
if [ -z "$pg_dir" ] || [ ! -x "$pg_dir/bin/postgres" ] || [ ! -x "$pg_dir/bin/initdb" ]; then
    say "no PostgreSQL server found (looked for /usr/lib/postgresql/<major>/bin/postgres);"
    say "install Debian's package first: apt-get install postgresql"
    exit 1
fi
major="$(basename "$pg_dir")"
share="/usr/share/postgresql/$major"
[ -d "$share" ] || { say "missing $share (the package's share files)"; exit 1; }

t0=$(date +%s%N)
work="$(mktemp -d "${TMPDIR:-/tmp}/aliquot-pg-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
mkdir -p "$rootfs"/{usr/bin,usr/lib,usr/share,usr/local/bin,etc,tmp,var/run/postgresql,var/lib/postgresql/data,proc,sys,dev,run}
ln -s usr/bin "$rootfs/bin"
ln -s usr/lib "$rootfs/lib"
chmod 1777 "$rootfs/tmp"

# The server: only what runs a cluster (no client tools but pg_isready, for
# the health check, and psql, for an operator's `docker exec`).
mkdir -p "$rootfs$pg_dir/bin"
for b in postgres initdb pg_ctl pg_isready psql; do
    cp -L "$pg_dir/bin/$b" "$rootfs$pg_dir/bin/"
done
# Without the JIT (llvmjit.so and its bitcode pull in ~200 MB of LLVM;
# the allocator's queries are too small to gain from it): jit = off.
mkdir -p "$rootfs$pg_dir/lib"
for f in "$pg_dir"/lib/*; do
    # and without the procedural languages but PL/pgSQL (libperl, libpython, libtcl).
    case "$(basename "$f")" in llvmjit*|bitcode|plperl*|plpython*|pltcl*) continue ;; esac
    cp -a "$f" "$rootfs$pg_dir/lib/"
done
mkdir -p "$rootfs/usr/share/postgresql"
cp -a "$share" "$rootfs/usr/share/postgresql/"
# Debian builds PostgreSQL --with-system-tzdata: initdb and the server read
# /usr/share/zoneinfo.
if [ -d /usr/share/zoneinfo ]; then cp -a /usr/share/zoneinfo "$rootfs/usr/share/"; fi

shell="$(readlink -f /bin/sh)"
cp -L "$shell" "$rootfs/usr/bin/dash"
ln -sf dash "$rootfs/usr/bin/sh"

# Every library those load, as ldd resolves them here.
libs_of() {
    ldd "$1" 2>/dev/null | awk '
        $2 == "=>" && $3 ~ /^\// { print $3 }
        $1 ~ /^\// { print $1 }'
}
libs=()
for f in "$rootfs$pg_dir"/bin/* "$rootfs$pg_dir"/lib/*.so "$shell"; do
    src="${f#"$rootfs"}"
    [ -e "$src" ] || src="$f"
    while IFS= read -r l; do libs+=("$l"); done < <(libs_of "$src")
done
for l in $(printf '%s\n' "${libs[@]}" | sort -u); do
    case "$l" in "$pg_dir"/*) continue ;; esac
    dest="$rootfs$l"
    mkdir -p "$(dirname "$dest")"
    if [ ! -e "$dest" ]; then cp -L "$l" "$dest"; fi
    real="$(readlink -f "$l")"
    if [ "$real" != "$l" ] && [ ! -e "$rootfs$real" ]; then
        mkdir -p "$(dirname "$rootfs$real")"
        cp -L "$l" "$rootfs$real"
    fi
done

cat >"$rootfs/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
postgres:x:999:999:PostgreSQL:/var/lib/postgresql:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
EOF
cat >"$rootfs/etc/group" <<'EOF'
root:x:0:
postgres:x:999:
nogroup:x:65534:
EOF
printf 'hosts: files dns\nnetworks: files\n' >"$rootfs/etc/nsswitch.conf"
: >"$rootfs/etc/hosts"
: >"$rootfs/etc/resolv.conf"
: >"$rootfs/etc/hostname"

cat >"$rootfs/usr/local/bin/aliquot-postgres" <<EOF
#!/bin/sh
# Initialise the data directory once, then run the server (see
# deploy/build-postgres-image.sh).
set -eu
PATH="$pg_dir/bin:\$PATH"
PGDATA="\${PGDATA:-/var/lib/postgresql/data}"
if [ ! -s "\$PGDATA/PG_VERSION" ]; then
    if [ -z "\${POSTGRES_PASSWORD:-}" ]; then
        echo "aliquot-postgres: POSTGRES_PASSWORD is empty: set the password of user aliquot" >&2
        exit 2
    fi
    # The password reaches initdb on a pipe, never in a file.
    printf '%s\n' "\$POSTGRES_PASSWORD" | initdb -D "\$PGDATA" --username=aliquot \\
        --pwfile=/dev/stdin --encoding=UTF8 --locale=C --auth-local=trust \\
        --auth-host=scram-sha-256 >/dev/null 2>&1 || {
        echo "aliquot-postgres: initdb failed" >&2; exit 1; }
    # Every address of the compose network, password only.
    echo "host all all all scram-sha-256" >>"\$PGDATA/pg_hba.conf"
    postgres --single -D "\$PGDATA" -c listen_addresses='' postgres >/dev/null <<SQL
CREATE DATABASE aliquot;
SQL
    echo "aliquot-postgres: initialised \$PGDATA (PostgreSQL $major)" >&2
fi
exec postgres -D "\$PGDATA" -c listen_addresses='*' \\
    -c unix_socket_directories=/var/run/postgresql -c jit=off "\$@"
EOF
chmod 755 "$rootfs/usr/local/bin/aliquot-postgres"

# The server's directories belong to its user (uid 999), so fresh named
# volumes mounted on them do too.
tar --numeric-owner -C "$rootfs" -cf "$work/rootfs.tar" \
    --exclude=./var/lib/postgresql --exclude=./var/run/postgresql .
tar --numeric-owner --owner=999 --group=999 -C "$rootfs" -rf "$work/rootfs.tar" \
    ./var/lib/postgresql ./var/run/postgresql
docker import \
    --change "LABEL org.aliquot.base=host-postgresql" \
    --change "ENV PATH=$pg_dir/bin:/usr/local/bin:/usr/bin:/bin" \
    --change 'ENV PGDATA=/var/lib/postgresql/data' \
    --change 'USER 999:999' \
    --change 'EXPOSE 5432' \
    --change 'CMD ["/usr/local/bin/aliquot-postgres"]' \
    -m "PostgreSQL $major from this host's Debian package (deploy/build-postgres-image.sh)" \
    "$work/rootfs.tar" "$tag" >/dev/null
t1=$(date +%s%N)
size="$(du -sh "$work/rootfs.tar" | cut -f1)"
say "made $tag: PostgreSQL $major from $pg_dir ($size, $(( (t1 - t0) / 1000000 )) ms)"
