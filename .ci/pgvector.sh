#!/usr/bin/env bash
# Installs PostgreSQL 15 and its pgvector extension from Debian, for the `pg` tests (run as root).
# Debian 12 (bookworm) ships no pgvector binary package (it starts with trixie's
# postgresql-17-pgvector), so where apt has none for this server we build Debian's own pgvector
# source (the trixie orig tarball, checked against its SHA-256) against postgresql-server-dev-15.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PG_MAJOR=15
PGVECTOR_VERSION=0.8.0
PGVECTOR_SHA256=867a2c328d4928a5a9d6f052cd3bc78c7d60228a9b914ad32aa3db88e9de27b0
extension_dir=/usr/share/postgresql/$PG_MAJOR/extension
[ -f "$extension_dir/vector.control" ] && exit 0
apt-get update -qq
if apt-cache show "postgresql-$PG_MAJOR-pgvector" >/dev/null 2>&1; then
    apt-get install -y -qq "postgresql-$PG_MAJOR" "postgresql-$PG_MAJOR-pgvector" >/dev/null
    exit 0
fi
apt-get install -y -qq "postgresql-$PG_MAJOR" "postgresql-server-dev-$PG_MAJOR" gcc make curl >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tarball=$work/pgvector_$PGVECTOR_VERSION.orig.tar.gz
curl -fsSL -o "$tarball" "http://deb.debian.org/debian/pool/main/p/pgvector/pgvector_$PGVECTOR_VERSION.orig.tar.gz"
echo "$PGVECTOR_SHA256  $tarball" | sha256sum --check --quiet
tar -xzf "$tarball" -C "$work"
# OPTFLAGS="" : no -march=native, so the library runs on any x86-64 CI machine.
make -s -C "$work/pgvector-$PGVECTOR_VERSION" PG_CONFIG="/usr/lib/postgresql/$PG_MAJOR/bin/pg_config" OPTFLAGS="" install >/dev/null
