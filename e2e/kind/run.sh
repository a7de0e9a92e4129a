#!/usr/bin/env bash
# `make e2e-kind`: retex with real images on a kind cluster.
#
#   1. create the kind cluster (e2e/kind/cluster.yaml: 1 control plane + 2 workers)
#   2. build images/Dockerfile's operator and worker targets, `kind load` them
#   3. apply manifests/overlays/dev (operator Deployment, dev Postgres, retex-examples namespace)
#      and the worker RBAC in retex-examples
#   4. smoke: examples/exec-pipeline.yaml must reach Succeeded with the deployed operator
#   5. scale the deployed operator to 0 and run the cluster scenario tests against the cluster
#      (RETEX_KUBECONFIG: the `rig` fixture then uses this cluster; each test runs its own operator)
#   6. on failure, collect logs into $RETEX_KIND_ARTIFACTS; always delete the cluster
#
# Knobs: RETEX_KIND_CLUSTER (default retex-e2e), RETEX_KIND_KEEP=1 (keep the cluster),
# RETEX_KIND_ARTIFACTS (default /tmp/retex-kind-artifacts), RETEX_KIND_TESTS (pytest arguments).
#
# Without docker or kind this prints why and exits 0 having run nothing. See docs/dev.md for what
# the scenario suite can and cannot do on kind today.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${RETEX_KIND_CLUSTER:-retex-e2e}
ARTIFACTS=${RETEX_KIND_ARTIFACTS:-/tmp/retex-kind-artifacts}
# The scenarios that need only an API server and real images. Tests whose worker pods write to the
# ledger need a Postgres the pods can reach (the test session's is on the host's loopback), and the
# nemeses (kill_node, pause_pod, ...) are rig-only: see docs/dev.md.
TESTS=${RETEX_KIND_TESTS:-tests/cluster/test_manifests.py tests/cluster/test_task_api.py}
PY=.venv/bin/python
say() { echo "[e2e-kind $(date +%H:%M:%S)] $*"; }

reasons=()
if ! command -v docker >/dev/null 2>&1; then
  reasons+=("docker is not on PATH")
elif ! docker info >/dev/null 2>&1; then
  reasons+=("the docker client is installed but no engine answers (docker info fails)")
fi
command -v kind >/dev/null 2>&1 || reasons+=("kind is not on PATH")
if ((${#reasons[@]})); then
  for reason in "${reasons[@]}"; do say "SKIPPED: $reason"; done
  say "make e2e-kind needs a running Docker engine and kind (https://kind.sigs.k8s.io): nothing was run."
  say "make test runs the cluster scenarios on the local rig instead."
  exit 0
fi

STATE=$(mktemp -d /tmp/retex-kind-XXXX)
export KUBECONFIG=$STATE/kubeconfig
collect_and_delete() {
  rc=$?
  if ((rc != 0)); then
    say "failed (exit $rc): collecting logs into $ARTIFACTS"
    mkdir -p "$ARTIFACTS"
    kind export logs "$ARTIFACTS/kind" --name "$CLUSTER" >/dev/null 2>&1 || true
    kubectl get all,tasks,leases,events -A -o wide >"$ARTIFACTS/objects.txt" 2>&1 || true
    kubectl logs -n retex-system deploy/retex-operator --tail=-1 >"$ARTIFACTS/operator.log" 2>&1 || true
    kubectl logs -n retex-system statefulset/retex-postgres --tail=-1 >"$ARTIFACTS/postgres.log" 2>&1 || true
  fi
  if [[ "${RETEX_KIND_KEEP:-}" == 1 ]]; then
    say "keeping cluster $CLUSTER (kubeconfig $KUBECONFIG); delete it with: kind delete cluster --name $CLUSTER"
  else
    say "deleting cluster $CLUSTER"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    rm -rf "$STATE"
  fi
  exit $rc
}
trap collect_and_delete EXIT

say "[1/6] creating kind cluster $CLUSTER (1 control plane + 2 workers)"
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
kind create cluster --name "$CLUSTER" --config e2e/kind/cluster.yaml --kubeconfig "$KUBECONFIG" --wait 180s

say "[2/6] building images (images/Dockerfile) and loading them into the nodes"
RETEX_IMAGE_TAG=dev bash images/build.sh  # `make images`: BuildKit, the local base where no registry answers
kind load docker-image retex-operator:dev retex-worker:dev --name "$CLUSTER"

say "[3/6] applying manifests/overlays/dev and onboarding retex-examples (manifests/tenant)"
kubectl apply --server-side -k manifests/overlays/dev
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
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
RETEX_KUBECONFIG=$KUBECONFIG "$PY" -m pytest $TESTS

say "[6/6] passed"
