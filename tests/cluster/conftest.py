"""Fixtures for scenarios that run all of retex on the cluster: CRD, namespace, operator."""

from __future__ import annotations

import contextlib
import itertools
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kubernetes import client

from e2e.patroni import PatroniCluster
from e2e.rig.controlplane import Rig
from e2e.stub import serve
from e2e.system import OperatorProcess, discard_namespace, install_crd, prepare_namespace
from retex.ledger import Ledger
from tests.cluster.gates import served_gates

_namespaces = itertools.count()


@pytest.fixture(scope="module")
def apis(rig, request):
    """Core and Batch API clients, and the module's own namespace (its NAMESPACE), removed after."""
    namespace = request.module.NAMESPACE
    rig.create_namespace(namespace)
    with rig.api_client() as api:
        yield client.CoreV1Api(api), client.BatchV1Api(api)
    rig.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@dataclass
class RetexOnCluster:
    rig: object
    operator: OperatorProcess
    ledger: Ledger
    namespace: str
    dsn: str  # the ledger database, for what the Ledger API does not show (the outbox)

    def kubectl(self, *args, **kwargs):
        return self.rig.kubectl("-n", self.namespace, *args, **kwargs)


@contextlib.contextmanager
def retex_running(rig, admin_dsn: str, dsn: str, database: str, namespace: str, log_path: Path,
                  **extra_env: str) -> Iterator[RetexOnCluster]:
    """retex against the rig on the ledger database `database` (made through `admin_dsn`, reached
    at `dsn`), with a tenant namespace and an operator process of its own, torn down after."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    install_crd(rig.kubectl)
    prepare_namespace(rig.kubectl, namespace)
    operator = OperatorProcess.on(rig, dsn, log_path, extra_env={"RETEX_NAMESPACES": namespace, **extra_env})
    operator.start()
    with Ledger(dsn, retry_for_seconds=60) as ledger:
        system = RetexOnCluster(rig=rig, operator=operator, ledger=ledger, namespace=namespace, dsn=dsn)
        try:
            yield system
        finally:
            operator.kill()
            print(f"--- operator log tail ({namespace}) ---\n{operator.log_tail()}")
            discard_namespace(rig.kubectl, namespace)


@pytest.fixture
def retex(rig, postgres, tmp_path) -> Iterator[RetexOnCluster]:
    """retex running against the rig: its own ledger database and tenant namespace per test, and a
    fresh operator process (tests may kill and restart it)."""
    number = next(_namespaces)
    database = f"retex_system_{number}"
    with retex_running(rig, postgres.dsn(), postgres.dsn(dbname=database), database, f"tenant-{number}",
                       Path(tmp_path) / "operator.log", RETEX_FAILPOINTS_FROM_ANNOTATIONS="1") as system:
        yield system


@contextlib.contextmanager
def patroni_cluster(rig, **options: Any) -> Iterator[PatroniCluster]:
    """A Patroni cluster (e2e.patroni) on the rig's etcd, for a module's tests; destroyed after."""
    if not isinstance(rig, Rig):
        pytest.skip("the Patroni cluster keeps its state in the local rig's etcd")
    cluster = PatroniCluster(etcd=f"127.0.0.1:{rig.ports['etcd']}", **options)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


def retex_on_patroni(rig, patroni: PatroniCluster, database: str, namespace: str,
                     log_path: Path) -> contextlib.AbstractContextManager[RetexOnCluster]:
    """retex whose ledger is the Patroni cluster's, through its multi-host read-write DSN."""
    return retex_running(rig, patroni.dsn(), patroni.dsn(dbname=database), database, namespace, log_path)


@dataclass
class Stub:
    url: str

    def counts(self) -> dict[str, dict[str, int]]:
        with urllib.request.urlopen(f"{self.url}/counts", timeout=5) as answer:
            return json.load(answer)

    def for_task(self, uid: str) -> dict[str, dict[str, int]]:
        """{effect: counts} of one task (keys are <task uid>:<step>:<version>)."""
        return {ident.split("/")[0]: c for ident, c in self.counts().items() if f"/{uid}:" in ident}

    def stored(self, effect: str, key: str) -> dict:
        request = urllib.request.Request(f"{self.url}/effects/{effect}", headers={"Idempotency-Key": key})
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.load(answer)


@pytest.fixture
def gates(rig):
    """Makes step gates where the pods reach this host (tests/cluster/gates.py)."""
    with served_gates(rig.pod_host) as gate:
        yield gate


@pytest.fixture(scope="module")
def stubs(rig, tmp_path_factory):
    """The payment provider (deduplicates by Idempotency-Key) and a notifier that does not, where
    the cluster's pods reach them."""
    state = tmp_path_factory.mktemp("stub")
    idempotent = serve(0, Path(state) / "payments.json", host=rig.pod_host)
    naive = serve(0, Path(state) / "notifier.json", idempotent=False, host=rig.pod_host)
    yield (Stub(f"http://{rig.pod_host}:{idempotent.server_address[1]}"),
           Stub(f"http://{rig.pod_host}:{naive.server_address[1]}"))
    idempotent.shutdown()
    naive.shutdown()
