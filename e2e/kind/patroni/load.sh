#!/usr/bin/env bash
# retex-patroni:<tag> (e2e/kind/patroni/Dockerfile: Debian bookworm's PostgreSQL 15 and Patroni on
# the project's Debian base) built here and `kind load`ed into a cluster, for manifests/ledger-patroni:
#   bash e2e/kind/patroni/load.sh <kind cluster> [tag, default dev]
# Docker's build cache, outside the repository, keeps the apt layer: a rebuild with nothing changed
# takes a second.
set -euo pipefail
cd "$(dirname "$0")/../../.."
CLUSTER=${1:?kind cluster name}
IMAGE=retex-patroni:${2:-dev}
KIND=$(bash e2e/kind/kind-path.sh)
DOCKER=$(command -v /usr/bin/docker || command -v docker)
say() { echo "[patroni-image $(date +%H:%M:%S)] $*" >&2; }

# The base images/build.sh made: its local Debian base where no registry answers, else the
# official slim Python image (Debian bookworm too).
BASE=retex-python-base:bookworm
"$DOCKER" image inspect "$BASE" >/dev/null 2>&1 || BASE=python:3.11-slim-bookworm
say "building $IMAGE on $BASE"
DOCKER_BUILDKIT=1 "$DOCKER" build -q --build-arg "BASE=$BASE" -t "$IMAGE" e2e/kind/patroni >/dev/null
say "loading $IMAGE into kind cluster $CLUSTER"
"$KIND" load docker-image "$IMAGE" --name "$CLUSTER" >/dev/null
