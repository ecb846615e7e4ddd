#!/usr/bin/env bash
# PostgreSQL server binaries for the many-workers tests (tests/pgserver.py starts a throwaway
# cluster of its own on 127.0.0.1, in a temporary folder). From Debian's packages. Where they
# can't be installed the script fails with one line saying why: the tests need a real server, and
# a missing one fails them (never a silent skip).
set -uo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    echo "postgresql: $(ls -d /usr/lib/postgresql/*/bin | tail -1)"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "ERROR: PostgreSQL is not installed and cannot be (needs root and apt-get): install Debian's postgresql package" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# no default cluster: the tests make their own, and nothing should listen on 5432 after CI
mkdir -p /etc/postgresql-common
echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
if apt-get update -qq && apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold postgresql >/dev/null
then
    echo "postgresql: $(ls -d /usr/lib/postgresql/*/bin | tail -1)"
else
    echo "ERROR: apt-get install postgresql failed; the PostgreSQL tests need it" >&2
    exit 1
fi
