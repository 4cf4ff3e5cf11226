#!/usr/bin/env bash
# The system packages the tests use, installed when missing: `make test` runs
# this first, so that it is exactly what CI runs and skips nothing.
#
#   redis-server, redis-cli   the mirror tests start their own Redis servers and a Redis Cluster
#   node, npm                 the Node.js example's test, and buf (tools/buf) for the contract's checks
#   docker-compose            validates the compose files (no container engine is needed)
#   promtool                  checks and unit-tests docker/observability's Prometheus rules and config
#                             (Debian's prometheus package, which brings the server too)
#
# Debian's packages, without recommends, as root or through sudo. Without
# either (or without apt-get), it names what to install and exits 1.
set -euo pipefail

declare -A package_of=(
    [redis-server]=redis-server [redis-cli]=redis-server [node]=nodejs [npm]=npm [docker-compose]=docker-compose
    [promtool]=prometheus
)
missing=()
for command in redis-server redis-cli node npm docker-compose promtool; do
    if ! command -v "$command" >/dev/null; then
        package=${package_of[$command]}
        [[ " ${missing[*]} " == *" $package "* ]] || missing+=("$package")
    fi
done
((${#missing[@]})) || exit 0

can_install=true
as_root=()
if ! command -v apt-get >/dev/null; then
    can_install=false
elif [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then as_root=(sudo); else can_install=false; fi
fi
if ! $can_install; then
    echo "make test: missing system packages: ${missing[*]}" >&2
    echo "  install them (Debian/Ubuntu: sudo apt-get install --no-install-recommends ${missing[*]})," >&2
    echo "  or run make test as root or with passwordless sudo, and it installs them" >&2
    exit 1
fi
echo "make test: installing ${missing[*]} (apt-get, without recommends)"
"${as_root[@]}" apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
