#!/usr/bin/env bash
# A kind cluster with retex deployed from images built here:
# `e2e/kind/up.sh <cluster> <kubeconfig> <workdir> [ledger]`.
#
#   1. create the kind cluster (e2e/kind/create-cluster.sh: e2e/kind/cluster.yaml, 1 control
#      plane + 2 workers, from kind's node image or one built here when it cannot be pulled);
#      a cluster of that name is deleted first
#   2. build images/Dockerfile's operator and worker targets, `kind load` them
#   3. apply manifests/overlays/dev (operator Deployment, dev Postgres, retex-examples namespace)
#      and the tenant onboarding of retex-examples; wait for both rollouts.
#      With `ledger` (`make kind-up`, the README's quickstart), only what the Helm chart does not
#      install: the namespace retex-system, the dev Postgres, the DSN Secret retex-operator-db,
#      the ledger endpoint's certificate and the namespace retex-examples (the chart onboards it)
#
# Used by `make e2e-kind` (e2e/kind/run.sh), by `make dev` on kind (e2e/dev.py) and by `make
# kind-up`. <workdir> keeps the kustomize overlay that names the Postgres image.
set -euo pipefail
cd "$(dirname "$0")/../.."
CLUSTER=${1:?cluster name}
export KUBECONFIG=${2:?kubeconfig path}
STATE=${3:?work directory}
WHAT=${4:-all}
KIND=$(bash e2e/kind/kind-path.sh)  # built by step 1's build-node.sh
say() { echo "[kind-up $(date +%H:%M:%S)] $*"; }

say "[1/3] creating kind cluster $CLUSTER (1 control plane + 2 workers; the node image is built here if it cannot be pulled)"
bash e2e/kind/build-node.sh >/dev/null  # builds kind itself too; progress on stderr
"$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
bash e2e/kind/create-cluster.sh "$CLUSTER" "$KUBECONFIG"

say "[2/3] building images (images/Dockerfile) and loading them into the nodes"
RETEX_IMAGE_TAG=dev bash images/build.sh  # `make images`: BuildKit, the local base where no registry answers
"$KIND" load docker-image retex-operator:dev retex-worker:dev --name "$CLUSTER"

if [[ $WHAT == ledger ]]; then
  say "[3/3] applying the dev Postgres (manifests/overlays/dev/postgres), its DSN Secret and the namespace retex-examples"
else
  say "[3/3] applying manifests/overlays/dev and onboarding retex-examples (manifests/tenant)"
fi
# The overlay's Postgres image, or where no registry serves it, one built here (Debian's
# PostgreSQL 15 started as the official image starts: e2e/kind/postgres-dev).
POSTGRES_IMAGE=postgres:17-bookworm
if ! docker image inspect "$POSTGRES_IMAGE" >/dev/null 2>&1 && ! docker pull -q "$POSTGRES_IMAGE" >/dev/null 2>&1; then
  POSTGRES_IMAGE=retex-postgres-dev:15-bookworm
  say "$POSTGRES_IMAGE built from e2e/kind/postgres-dev: no registry serves postgres:17-bookworm"
  DOCKER_BUILDKIT=1 "$(command -v /usr/bin/docker || command -v docker)" build -q -t "$POSTGRES_IMAGE" e2e/kind/postgres-dev >/dev/null
fi
"$KIND" load docker-image "$POSTGRES_IMAGE" --name "$CLUSTER"
mkdir -p "$STATE/overlay"
if [[ $WHAT == ledger ]]; then
  kubectl apply -f manifests/base/namespace.yaml
  resources="$(realpath --relative-to="$STATE/overlay" manifests/overlays/dev/postgres)"
  resources+=", $(realpath --relative-to="$STATE/overlay" manifests/overlays/dev/examples-namespace)"
else
  resources=$(realpath --relative-to="$STATE/overlay" manifests/overlays/dev)
fi
cat >"$STATE/overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [$resources]
images: [{name: postgres, newName: ${POSTGRES_IMAGE%%:*}, newTag: ${POSTGRES_IMAGE#*:}}]
EOF
kubectl apply --server-side -k "$STATE/overlay"
manifests/ledger-tls.sh retex-system  # the ledger endpoint's certificate (the operator mounts it)
if [[ $WHAT == ledger ]]; then
  # The dev overlay's DSN (manifests/overlays/dev/kustomization.yaml), in the Secret the chart reads.
  kubectl create secret generic retex-operator-db -n retex-system --dry-run=client -o yaml \
    --from-literal=dsn='host=retex-postgres.retex-system.svc port=5432 dbname=retex user=retex password=retex-dev-only' \
    | kubectl apply -f -
  kubectl rollout status -n retex-system statefulset/retex-postgres --timeout=180s
  exit 0
fi
kubectl apply -n retex-examples -k manifests/tenant
kubectl rollout status -n retex-system statefulset/retex-postgres --timeout=180s
kubectl rollout status -n retex-system deployment/retex-operator --timeout=180s
