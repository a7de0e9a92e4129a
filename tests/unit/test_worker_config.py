"""The worker's environment contract with the operator's Job."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from retex.worker.config import DEFAULT_DRAIN_SECONDS, ConfigError, WorkerConfig

ENV = {"RETEX_TASK_UID": "u-1", "RETEX_TASK_NAMESPACE": "shop", "RETEX_TASK_NAME": "order-1", "RETEX_EPOCH": "3",
       "RETEX_SPEC_HASH": "ab" * 32,
       "RETEX_LEASE_NAME": "order-1-abcd", "RETEX_LEASE_DURATION_SECONDS": "15",
       "RETEX_LEDGER_URL": "http://retex-ledger:8081", "POD_NAME": "order-1-abcd-3-xyz", "NODE_NAME": "node-a"}


def test_every_variable_the_job_sets_is_read():
    config = WorkerConfig.from_env(ENV)
    assert (config.task_uid, config.namespace, config.name, config.epoch) == ("u-1", "shop", "order-1", 3)
    assert (config.lease_name, config.lease_duration_seconds) == ("order-1-abcd", 15)
    assert (config.pod_name, config.node_name, config.drain_seconds) == ("order-1-abcd-3-xyz", "node-a",
                                                                          DEFAULT_DRAIN_SECONDS)


def test_pod_name_falls_back_to_the_hostname_and_node_name_is_optional():
    config = WorkerConfig.from_env({k: v for k, v in ENV.items() if k not in ("POD_NAME", "NODE_NAME")})
    assert config.pod_name == socket.gethostname() and config.node_name is None


@pytest.mark.parametrize("missing", ["RETEX_TASK_UID", "RETEX_EPOCH", "RETEX_SPEC_HASH", "RETEX_LEDGER_URL",
                                     "RETEX_LEASE_NAME"])
def test_a_missing_variable_is_refused(missing):
    with pytest.raises(ConfigError, match=missing):
        WorkerConfig.from_env({k: v for k, v in ENV.items() if k != missing})


def test_a_non_integer_epoch_is_refused():
    with pytest.raises(ConfigError, match="RETEX_EPOCH"):
        WorkerConfig.from_env({**ENV, "RETEX_EPOCH": "three"})


def test_the_console_script_exits_2_on_a_bad_environment_before_touching_anything():
    worker = Path(sys.executable).parent / "retex-worker"
    done = subprocess.run([str(worker)], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert done.returncode == 2 and "RETEX_TASK_UID is not set" in done.stderr
