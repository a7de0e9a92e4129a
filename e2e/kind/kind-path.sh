#!/usr/bin/env bash
# Prints the kind binary every script here uses: the pinned version e2e/kind/build-node.sh builds
# into the cache (it builds it on every path, also where kind's own node image can be pulled).
here=$(cd "$(dirname "$0")" && pwd)
echo "${RETEX_CACHE:-$HOME/.cache/retex}/bin/kind-$(sed -n 's/^KIND_VERSION=//p' "$here/build-node.sh")/kind"
