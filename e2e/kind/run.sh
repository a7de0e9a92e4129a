#!/usr/bin/env bash
# `make e2e-kind`: retex with real images on a kind cluster.
#
#   1. create the kind cluster (e2e/kind/create-cluster.sh: e2e/kind/cluster.yaml, 1 control
#      plane + 2 workers, from kind's node image or one built here when it cannot be pulled)
#   2. build images/Dockerfile's operator and worker targets, `kind load` them
#   3. apply manifests/overlays/dev (operator Deployment, dev Postgres, retex-examples namespace)
#      and the worker RBAC in retex-examples
#   4. smoke: examples/exec-pipeline.yaml must reach Succeeded with the deployed operator
#   5. scale the deployed operator to 0 and run the cluster scenario tests against the cluster
#      (RETEX_KUBECONFIG + RETEX_KIND_CLUSTER: the `rig` fixture is then e2e/rig/external.py's
#      KindCluster; each test runs its own operator on this host, its worker pods run the
#      built image and reach the host at the kind network's gateway, RETEX_POD_HOST)
#   6. on failure, collect logs into $RETEX_KIND_ARTIFACTS; always delete the cluster
#
# Knobs: RETEX_KIND_CLUSTER (default retex-e2e), RETEX_KIND_KEEP=1 (keep the cluster),
# RETEX_KIND_ARTIFACTS (default /tmp/retex-kind-artifacts), RETEX_KIND_TESTS (pytest arguments).
#
# Without a Docker engine this prints why and exits 0 having run nothing. See docs/dev.md for what
# the scenario suite can and cannot do on kind today.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${RETEX_KIND_CLUSTER:-retex-e2e}
ARTIFACTS=${RETEX_KIND_ARTIFACTS:-/tmp/retex-kind-artifacts}
# The scenarios that run on kind (docs/dev.md, "What runs on kind"): the manifests and Task API,
# and the whole crash matrix.
DEFAULT_TESTS='tests/cluster/test_manifests.py tests/cluster/test_task_api.py tests/cluster/test_crash_matrix.py'
TESTS=${RETEX_KIND_TESTS:-$DEFAULT_TESTS}
PY=.venv/bin/python
say() { echo "[e2e-kind $(date +%H:%M:%S)] $*"; }

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  say "SKIPPED: no Docker engine answers (docker info fails); images/docker-engine.sh installs and starts one"
  say "make e2e-kind needs a running Docker engine: nothing was run. make test runs the cluster scenarios on the local rig."
  exit 0
fi

# kind: the one on PATH, else the one e2e/kind/build-node.sh builds into the cache (step 1).
KIND=$(command -v kind || echo "${RETEX_CACHE:-$HOME/.cache/retex}/bin/kind-$(sed -n 's/^KIND_VERSION=//p' e2e/kind/build-node.sh)/kind")
STATE=$(mktemp -d /tmp/retex-kind-XXXX)
export KUBECONFIG=$STATE/kubeconfig
collect_and_delete() {
  rc=$?
  if ((rc != 0)); then
    say "failed (exit $rc): collecting logs into $ARTIFACTS"
    mkdir -p "$ARTIFACTS"
    "$KIND" export logs "$ARTIFACTS/kind" --name "$CLUSTER" >/dev/null 2>&1 || true
    kubectl get all,tasks,leases,events -A -o wide >"$ARTIFACTS/objects.txt" 2>&1 || true
    kubectl logs -n retex-system deploy/retex-operator --tail=-1 >"$ARTIFACTS/operator.log" 2>&1 || true
    kubectl logs -n retex-system statefulset/retex-postgres --tail=-1 >"$ARTIFACTS/postgres.log" 2>&1 || true
  fi
  if [[ "${RETEX_KIND_KEEP:-}" == 1 ]]; then
    say "keeping cluster $CLUSTER (kubeconfig $KUBECONFIG); delete it with: $KIND delete cluster --name $CLUSTER"
  else
    say "deleting cluster $CLUSTER"
    "$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    rm -rf "$STATE"
  fi
  exit $rc
}
trap collect_and_delete EXIT

say "[1/6] creating kind cluster $CLUSTER (1 control plane + 2 workers; the node image is built here if it cannot be pulled)"
bash e2e/kind/build-node.sh >/dev/null  # builds kind itself too; progress on stderr
"$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
bash e2e/kind/create-cluster.sh "$CLUSTER" "$KUBECONFIG"

say "[2/6] building images (images/Dockerfile) and loading them into the nodes"
RETEX_IMAGE_TAG=dev bash images/build.sh  # `make images`: BuildKit, the local base where no registry answers
"$KIND" load docker-image retex-operator:dev retex-worker:dev --name "$CLUSTER"

say "[3/6] applying manifests/overlays/dev and onboarding retex-examples (manifests/tenant)"
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
cat >"$STATE/overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [$(realpath --relative-to="$STATE/overlay" manifests/overlays/dev)]
images: [{name: postgres, newName: ${POSTGRES_IMAGE%%:*}, newTag: ${POSTGRES_IMAGE#*:}}]
EOF
kubectl apply --server-side -k "$STATE/overlay"
manifests/ledger-tls.sh retex-system  # the ledger endpoint's certificate (the operator mounts it)
kubectl apply -n retex-examples -k manifests/tenant
kubectl rollout status -n retex-system statefulset/retex-postgres --timeout=180s
kubectl rollout status -n retex-system deployment/retex-operator --timeout=180s

say "[4/6] smoke: examples/exec-pipeline.yaml on the deployed operator and images"
kubectl apply -n retex-examples -f examples/exec-pipeline.yaml
kubectl wait -n retex-examples --for=condition=Succeeded task/word-count-pipeline --timeout=180s
kubectl get tasks -n retex-examples

say "[5/6] scenario tests against the kind cluster: $TESTS"
kubectl scale -n retex-system deployment/retex-operator --replicas=0
kubectl wait -n retex-system --for=delete pod -l app.kubernetes.io/component=operator --timeout=60s
# The host's address on the kind network: where the worker pods reach the operator a test runs
# and the stubs.
POD_HOST=$(docker network inspect kind -f '{{range .IPAM.Config}}{{if .Gateway}}{{.Gateway}} {{end}}{{end}}' | tr ' ' '\n' | grep -m1 -E '^[0-9.]+$')
say "pods reach this host at $POD_HOST"
# eval: RETEX_KIND_TESTS is pytest's command line, quotes included.
export RETEX_KUBECONFIG=$KUBECONFIG RETEX_KIND_CLUSTER=$CLUSTER RETEX_POD_HOST=$POD_HOST RETEX_WORKER_IMAGE=retex-worker:dev
eval "$PY" -m pytest "$TESTS"

say "[6/6] passed"
