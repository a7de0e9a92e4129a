"""The worker stays out of the operator's world: it never imports kopf, and what a python step's
child interpreter imports from retex.worker stays light."""

import subprocess
import sys


def modules_after(statement: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{statement}; import sys; print(' '.join(sys.modules))"],
                         check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_the_worker_never_imports_kopf_or_the_operator():
    loaded = modules_after("import retex.worker.main")
    assert "kopf" not in loaded
    assert not any(name.startswith("retex.operator") for name in loaded)


def test_step_code_importing_retex_worker_does_not_pull_in_kubernetes_or_the_ledger():
    loaded = modules_after("from retex.worker import PermanentError, RetryableError, StepContext")
    assert "kubernetes" not in loaded and "psycopg" not in loaded


def test_the_worker_reaches_the_ledger_without_importing_psycopg():
    # Workers talk HTTP to the ledger endpoint; psycopg is import time in every pod for nothing.
    loaded = modules_after("import retex.worker.main")
    assert "psycopg" not in loaded and "psycopg_pool" not in loaded
    assert "retex.ledger.store" not in loaded


def test_the_ledger_store_still_comes_with_the_ledger_package_on_first_use():
    loaded = modules_after("from retex.ledger import Ledger, NOTIFY_CHANNEL, spec_hash")
    assert "psycopg" in loaded and "retex.ledger.store" in loaded


def test_a_python_steps_child_interpreter_loads_no_other_step_runner():
    # `python -m retex.worker.steps.pycall` imports the package first: it must stay empty.
    loaded = modules_after("import retex.worker.steps.pycall")
    runners = {"retex.worker.steps.by_kind", "retex.worker.steps.exec_step", "retex.worker.steps.http_step",
               "retex.worker.steps.python_step"}
    assert not runners & loaded


def test_the_worker_never_imports_the_kubernetes_package():
    # ~150 ms of every worker pod's start for two Lease calls: retex.kube.rest makes them instead.
    loaded = modules_after("import retex.worker.main")
    assert not {name for name in loaded if name == "kubernetes" or name.startswith("kubernetes.")}
