"""One install owns a ledger: an operator of another install (its own namespace, so its own
install uid on its own retex-install Lease) pointed at the same database refuses to start with a
clear error, instead of taking the leadership term from the install that owns it; the owner's own
replicas and restarts keep one uid."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg

from e2e.system import OperatorProcess, install_crd, prepare_namespace, wait_for


def install_uid(rig, namespace: str) -> str:
    lease = json.loads(rig.kubectl("get", "lease", "retex-install", "-n", namespace, "-o", "json").stdout)
    return lease["metadata"]["annotations"]["retex.dev/install-uid"]


def ledger_owner_and_term(dsn: str) -> tuple[str, int]:
    with psycopg.connect(dsn) as conn:
        owner = conn.execute("SELECT uid FROM retex.install").fetchone()[0]
        term = conn.execute("SELECT term FROM retex.leadership").fetchone()[0]
    return owner, term


def test_an_operator_of_another_install_refuses_a_ledger_it_does_not_own(rig, postgres, tmp_path):
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE retex_shared_ledger")
    dsn = postgres.dsn(dbname="retex_shared_ledger")
    install_crd(rig.kubectl)
    for namespace in ("install-a", "install-b"):
        prepare_namespace(rig.kubectl, namespace)
    owner = OperatorProcess.on(rig, dsn, Path(tmp_path) / "a.log", extra_env={"RETEX_NAMESPACES": "install-a"})
    other = OperatorProcess.on(rig, dsn, Path(tmp_path) / "b.log", extra_env={"RETEX_NAMESPACES": "install-b"})
    try:
        owner.start()
        owner.wait_leading()
        uid_a = install_uid(rig, "install-a")
        owned, term = ledger_owner_and_term(dsn)
        assert owned == uid_a

        other.start()
        code = wait_for(other.exited, timeout=60, what="the other install's operator to exit")
        assert code == 1
        said = [json.loads(line) for line in other.log_tail(10**6).splitlines() if line.startswith("{")]
        refusal = [line for line in said if line.get("msg") == "not starting: the ledger belongs to another install"]
        assert refusal and refusal[0]["level"] == "error" and f"retex install {uid_a}" in refusal[0]["why"]
        assert install_uid(rig, "install-b") != uid_a
        assert ledger_owner_and_term(dsn) == (uid_a, term), "the owner keeps its ledger and its term"

        owner.restart()  # a restart of the owner is the same install
        owner.wait_leading()
        assert install_uid(rig, "install-a") == uid_a and ledger_owner_and_term(dsn)[0] == uid_a
    finally:
        owner.kill()
        other.kill()
        for namespace in ("install-a", "install-b"):
            rig.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
