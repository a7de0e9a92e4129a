#!/usr/bin/env bash
# `make e2e-kind`: retex with real images on a kind cluster.
#
#   1. `make dev` on kind (e2e/dev.py, RETEX_DEV_CLUSTER=kind): e2e/kind/up.sh (the cluster, both
#      images loaded into it, manifests/overlays/dev with its Postgres, retex-examples onboarded),
#      the counting stub on this host, the examples applied
#   2. smoke: the examples reach their ends with the deployed operator (a real http step to the stub)
#   3. scale the deployed operator to 0 and run the cluster scenario tests against the cluster
#      (RETEX_KUBECONFIG + RETEX_KIND_CLUSTER: the `rig` fixture is then e2e/rig/external.py's
#      KindCluster; each test runs its own operator on this host, its worker pods run the
#      built image and reach the host at the kind network's gateway, RETEX_POD_HOST)
#   4. on failure, collect logs into $RETEX_KIND_ARTIFACTS; always delete the cluster
#
# Knobs: RETEX_KIND_CLUSTER (default retex-e2e), RETEX_KIND_KEEP=1 (keep the cluster),
# RETEX_KIND_ARTIFACTS (default /tmp/retex-kind-artifacts), RETEX_KIND_TESTS (pytest arguments).
#
# Without a Docker engine this prints why and fails (exit 1) having run nothing. See
# docs/contributing/development.md for what the scenario suite can and cannot do on kind.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${RETEX_KIND_CLUSTER:-retex-e2e}
ARTIFACTS=${RETEX_KIND_ARTIFACTS:-/tmp/retex-kind-artifacts}
# The scenarios that run on kind (docs/contributing/development.md, "What runs on kind"): every file
# of tests/cluster but those that prove the local rig itself (test_rig_*), `make dev` on the rig
# (test_dev), the README's quickstart (test_quickstart: a kind cluster of its own) and the noisy
# neighbour (test_noisy_neighbours: its hostile pods' CPU priority is set on the rig's node agents;
# kind's is not built) —
# the manifests and Task API, the whole crash matrix, the bounded chaos run and the deployed one
# (nemeses as pods), the dev Postgres's forced delete, the operator, its HA and probes, policies,
# the reaper, RBAC, tenancy, the status mirror, the relay, step secrets, metrics, the CLI as a
# user, the worker's lease, paging, Prometheus, the bench's smoke, node confinement, the
# finalizer at creation, the ledger restored from a backup and a second install on one ledger
# (the Patroni failovers, synchronous and asynchronous, skip there: their clusters keep their
# state in the rig's etcd), the deployed operator through a failover of manifests/ledger-patroni's
# Patroni StatefulSet; the chart last (it swaps the deployed manifests for a Helm release and back).
DEFAULT_TESTS='tests/cluster/test_manifests.py tests/cluster/test_task_api.py tests/cluster/test_crash_matrix.py
  tests/cluster/test_chaos.py tests/cluster/test_deployed_chaos.py tests/cluster/test_dev_postgres.py
  tests/cluster/test_operator.py tests/cluster/test_operator_ha.py tests/cluster/test_operator_probes.py
  tests/cluster/test_policies.py tests/cluster/test_reaper.py tests/cluster/test_rbac.py tests/cluster/test_tenancy_rbac.py
  tests/cluster/test_tenancy.py tests/cluster/test_tenancy_policy.py tests/cluster/test_status_mirror.py
  tests/cluster/test_relay.py tests/cluster/test_step_secrets.py tests/cluster/test_metrics.py
  tests/cluster/test_cli_as_user.py tests/cluster/test_worker_lease.py tests/cluster/test_kube_calls_paging.py
  tests/cluster/test_prometheus.py tests/cluster/test_confined_nodes.py tests/cluster/test_bench.py
  tests/cluster/test_finalizer_at_create.py tests/cluster/test_ledger_restore.py tests/cluster/test_install_identity.py
  tests/cluster/test_ledger_failover.py tests/cluster/test_ledger_async_failover.py
  tests/cluster/test_deployed_ledger_failover.py tests/cluster/test_watched_labels.py tests/cluster/test_namespace_quota.py
  tests/cluster/test_tenant_fair_share.py tests/cluster/test_chart_on_rig.py'
TESTS=${RETEX_KIND_TESTS:-$DEFAULT_TESTS}
PY=.venv/bin/python
say() { echo "[e2e-kind $(date +%H:%M:%S)] $*"; }

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  say "no Docker engine answers (docker info fails); images/docker-engine.sh installs and starts one"
  say "make e2e-kind needs a running Docker engine: nothing was run. make test runs the cluster scenarios on the local rig."
  exit 1
fi

KIND=$(bash e2e/kind/kind-path.sh)  # built by step 1 (e2e/kind/build-node.sh)
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
    cp "$STATE"/stub.log "$STATE"/stub-state.json "$ARTIFACTS/" 2>/dev/null || true
  fi
  if [[ "${RETEX_KIND_KEEP:-}" == 1 ]]; then
    say "keeping cluster $CLUSTER (kubeconfig $KUBECONFIG) and the examples' stub; stop both with: $PY -m e2e.dev down --state-dir $STATE"
  else
    say "deleting cluster $CLUSTER and stopping the stub"
    "$PY" -m e2e.dev down --state-dir "$STATE" >/dev/null 2>&1 || true
    "$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true  # also when `up` failed before recording it
    rm -rf "$STATE"
  fi
  exit $rc
}
trap collect_and_delete EXIT

say "[1/4] make dev on kind (RETEX_DEV_CLUSTER=kind python -m e2e.dev up): the cluster $CLUSTER, retex deployed from images built here, the stub, the examples"
RETEX_DEV_CLUSTER=kind RETEX_DEV_KIND_CLUSTER=$CLUSTER "$PY" -m e2e.dev up --state-dir "$STATE"

say "[2/4] smoke: the examples reach their ends on the deployed operator and images"
kubectl wait -n retex-examples --for=condition=Succeeded task/word-count-pipeline task/order-1042 --timeout=180s
kubectl wait -n retex-examples --for=condition=DeadLettered task/notify-partner --timeout=180s
kubectl get tasks -n retex-examples

say "[3/4] scenario tests against the kind cluster: $TESTS"
kubectl scale -n retex-system deployment/retex-operator --replicas=0
kubectl wait -n retex-system --for=delete pod -l app.kubernetes.io/component=operator --timeout=60s
# The host's address on the kind network, where step 1 put the stub: where the worker pods reach
# the operator a test runs and the stubs.
POD_HOST=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["pod_host"])' "$STATE/dev.json")
say "pods reach this host at $POD_HOST"
# eval: RETEX_KIND_TESTS is pytest's command line, quotes included; the default list's newlines
# become spaces, or eval would end the command at each (tests/unit/test_kind_run_script.py).
export RETEX_KUBECONFIG=$KUBECONFIG RETEX_KIND_CLUSTER=$CLUSTER RETEX_POD_HOST=$POD_HOST RETEX_WORKER_IMAGE=retex-worker:dev
eval "$PY" -m pytest "${TESTS//$'\n'/ }"

say "[4/4] passed"
