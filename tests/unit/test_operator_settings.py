"""The operator's settings from its environment: documented defaults, and a clear refusal (exit
with the variable's name) for a value that cannot work, before anything starts."""

from __future__ import annotations

import os

import pytest

from retex.kube.election import ElectionTiming
from retex.ledger import SessionLimits
from retex.operator.settings import LiveWorkerDefaults, OperatorSettings, session_limits

# Plain HTTP for the ledger endpoint, so each test below is about its own variable; the TLS tests
# say so themselves.
DSN = {"RETEX_DATABASE_URL": "host=db dbname=retex sslmode=verify-full", "RETEX_LEDGER_INSECURE": "1"}
SECURE_DSN = {"RETEX_DATABASE_URL": DSN["RETEX_DATABASE_URL"]}


@pytest.fixture
def tls_files(tmp_path) -> dict[str, str]:
    files = {}
    for name, variable in [("tls.crt", "RETEX_LEDGER_TLS_CERT_FILE"), ("tls.key", "RETEX_LEDGER_TLS_KEY_FILE"),
                           ("ca.crt", "RETEX_LEDGER_CA_FILE")]:
        (tmp_path / name).write_text(f"-----BEGIN {name}-----\n")
        files[variable] = str(tmp_path / name)
    return files


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(SystemExit) as exited:
        OperatorSettings.from_env(env)
    return str(exited.value)


def test_only_the_dsn_and_the_ledger_certificate_are_required_and_the_rest_are_the_documented_defaults(tls_files):
    settings = OperatorSettings.from_env(SECURE_DSN | tls_files)
    assert settings.database_url == "host=db dbname=retex sslmode=verify-full"
    assert (settings.max_running, settings.max_running_per_namespace) == (None, None)
    assert settings.history_retention_days == 7.0  # finished tasks leave the ledger a week after they end
    assert (settings.namespace_max_tasks, settings.namespace_max_result_bytes) == (100_000, 2**30)
    assert (settings.worker_start_deadline_seconds, settings.resync_seconds, settings.metrics_port) == (120.0, 30.0, 9090)
    assert settings.dispatch_defer_limit_seconds == 600.0
    assert settings.ledger_port == 8081
    assert settings.worker.ledger_url == "https://retex-ledger.retex-system.svc:8081"
    assert settings.ledger_tls.cert_file == tls_files["RETEX_LEDGER_TLS_CERT_FILE"]
    assert settings.worker.ledger_ca == "-----BEGIN ca.crt-----\n"  # handed to workers through their Jobs
    assert (settings.worker.image, settings.worker.service_account) == ("retex-worker:latest", "retex-worker")
    assert settings.worker.termination_grace_seconds == 30 and not settings.failpoints_from_annotations


def test_without_a_dsn_the_operator_refuses_to_start_and_says_which_variable():
    assert "RETEX_DATABASE_URL is not set" in refusal({})


@pytest.mark.parametrize("dsn", ["host=db dbname=retex", "host=db dbname=retex sslmode=require",
                                 "host=db sslmode=verify-ca", "postgresql://retex@db/retex?sslmode=prefer",
                                 "postgresql://retex@db/retex"])
def test_a_dsn_without_sslmode_verify_full_is_refused_and_the_refusal_says_what_to_do(dsn):
    message = refusal({"RETEX_DATABASE_URL": dsn})
    assert "sslmode=verify-full" in message and "RETEX_DATABASE_INSECURE=1" in message


@pytest.mark.parametrize("dsn", ["host=db dbname=retex sslmode=verify-full",
                                 "postgresql://retex:pw@db/retex?sslmode=verify-full"])
def test_a_dsn_with_sslmode_verify_full_is_accepted(dsn):
    assert OperatorSettings.from_env({"RETEX_DATABASE_URL": dsn, "RETEX_LEDGER_INSECURE": "1"}).database_url == dsn


def test_pgsslmode_verify_full_in_the_environment_counts_as_the_dsns_own():
    assert OperatorSettings.from_env({"RETEX_DATABASE_URL": "host=db", "PGSSLMODE": "verify-full",
                                      "RETEX_LEDGER_INSECURE": "1"})
    assert "sslmode=verify-full" in refusal({"RETEX_DATABASE_URL": "host=db sslmode=disable",
                                             "PGSSLMODE": "verify-full"})  # the DSN's own wins, as in libpq


def test_the_explicit_insecure_flag_accepts_a_dsn_without_tls_verification():
    env = {"RETEX_DATABASE_URL": "host=127.0.0.1 dbname=retex", "RETEX_DATABASE_INSECURE": "1",
           "RETEX_LEDGER_INSECURE": "1"}
    assert OperatorSettings.from_env(env).database_url == "host=127.0.0.1 dbname=retex"
    assert "sslmode=verify-full" in refusal(env | {"RETEX_DATABASE_INSECURE": "yes"})  # only 1 means it


def test_a_dsn_that_does_not_parse_is_refused_without_echoing_it():
    message = refusal({"RETEX_DATABASE_URL": "password=hunter2 bogus", "RETEX_DATABASE_INSECURE": "1"})
    assert "RETEX_DATABASE_URL" in message and "hunter2" not in message


@pytest.mark.parametrize("name", ["RETEX_MAX_RUNNING", "RETEX_MAX_RUNNING_PER_NAMESPACE", "RETEX_NAMESPACE_MAX_TASKS",
                                  "RETEX_NAMESPACE_MAX_RESULT_BYTES", "RETEX_WORKER_START_DEADLINE_SECONDS", "RETEX_DISPATCH_DEFER_LIMIT_SECONDS",
                                  "RETEX_LEDGER_PORT", "RETEX_METRICS_PORT",
                                  "RETEX_WORKER_GRACE_SECONDS", "RETEX_RESYNC_SECONDS"])
def test_a_value_that_is_not_a_number_is_refused_by_name(name):
    assert refusal(DSN | {name: "ten"}) == f"{name}='ten' is not a number"


@pytest.mark.parametrize("name", ["RETEX_MAX_RUNNING", "RETEX_NAMESPACE_MAX_TASKS", "RETEX_LEDGER_PORT",
                                  "RETEX_WORKER_GRACE_SECONDS", "RETEX_RESYNC_SECONDS"])
@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_zero_a_negative_or_an_infinite_value_is_refused(name, value):
    assert refusal(DSN | {name: value}) in (f"{name} must be positive (unset it for the default)",
                                            f"{name}={value!r} is not a number")


@pytest.mark.parametrize(("value", "days"), [("off", None), (" OFF ", None), ("30", 30.0), ("0.5", 0.5), ("", 7.0)])
def test_history_retention_is_a_number_of_days_or_off(value, days):
    assert OperatorSettings.from_env(DSN | {"RETEX_HISTORY_RETENTION_DAYS": value}).history_retention_days == days


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "never", "7d", "false"])
def test_a_history_retention_that_is_not_a_positive_number_of_days_or_off_is_refused_saying_what_is_accepted(value):
    assert refusal(DSN | {"RETEX_HISTORY_RETENTION_DAYS": value}) == (
        f"RETEX_HISTORY_RETENTION_DAYS={value!r}: give a positive number of days (finished tasks are purged that "
        "long after they end; default 7), or off to keep them for ever")


def test_namespace_quotas_are_taken_as_given():
    settings = OperatorSettings.from_env(DSN | {"RETEX_NAMESPACE_MAX_TASKS": "50",
                                                "RETEX_NAMESPACE_MAX_RESULT_BYTES": "1048576"})
    assert (settings.namespace_max_tasks, settings.namespace_max_result_bytes) == (50, 1048576)


def test_limits_and_the_workers_ledger_url_are_taken_as_given():
    settings = OperatorSettings.from_env(DSN | {"RETEX_MAX_RUNNING": "7", "RETEX_LEDGER_PORT": "9443",
                                                "RETEX_LEDGER_URL": "http://retex-ledger.ops.svc:9443",
                                                "RETEX_METRICS_PORT": ""})
    assert settings.max_running == 7 and settings.ledger_port == 9443 and settings.metrics_port is None
    assert settings.worker.ledger_url == "http://retex-ledger.ops.svc:9443"


def test_a_port_above_65535_is_refused():
    assert refusal(DSN | {"RETEX_LEDGER_PORT": "70000"}) == "RETEX_LEDGER_PORT='70000' is not a port (1 to 65535)"


def test_without_a_certificate_for_the_ledger_endpoint_the_operator_refuses_to_start_and_says_what_to_set():
    message = refusal(SECURE_DSN)
    assert "needs TLS" in message and "RETEX_LEDGER_TLS_CERT_FILE" in message and "RETEX_LEDGER_INSECURE=1" in message


def test_part_of_the_ledger_certificate_is_refused_naming_what_is_unset(tls_files):
    del tls_files["RETEX_LEDGER_CA_FILE"]
    assert refusal(SECURE_DSN | tls_files).endswith("unset: RETEX_LEDGER_CA_FILE")


def test_a_ledger_certificate_file_that_is_missing_is_refused(tls_files):
    tls_files["RETEX_LEDGER_TLS_KEY_FILE"] = "/nowhere/tls.key"
    assert "not readable: RETEX_LEDGER_TLS_KEY_FILE=/nowhere/tls.key" in refusal(SECURE_DSN | tls_files)


def test_a_plain_http_ledger_url_with_tls_served_is_refused(tls_files):
    assert "https://" in refusal(SECURE_DSN | tls_files | {"RETEX_LEDGER_URL": "http://retex-ledger:8081"})


def test_the_insecure_flag_serves_plain_http_and_hands_workers_no_ca():
    settings = OperatorSettings.from_env(DSN)
    assert settings.ledger_tls is None and settings.worker.ledger_ca is None
    assert settings.worker.ledger_url == "http://retex-ledger.retex-system.svc:8081"


def test_leader_election_defaults_to_15_10_2_seconds_on_a_lease_in_retex_system():
    settings = OperatorSettings.from_env(DSN)
    election = settings.leader_election
    assert (election.lease_duration, election.renew_deadline, election.retry_period) == (15.0, 10.0, 2.0)
    assert settings.operator_namespace == "retex-system"


def test_leader_election_timing_and_namespace_are_taken_as_given():
    settings = OperatorSettings.from_env(DSN | {"RETEX_LEADER_LEASE_SECONDS": "4", "RETEX_LEADER_RENEW_DEADLINE_SECONDS": "3",
                                                "RETEX_LEADER_RETRY_SECONDS": "0.5", "RETEX_OPERATOR_NAMESPACE": "ops"})
    election = settings.leader_election
    assert (election.lease_duration, election.renew_deadline, election.retry_period) == (4.0, 3.0, 0.5)
    assert settings.operator_namespace == "ops"


@pytest.mark.parametrize("env", [{"RETEX_LEADER_RENEW_DEADLINE_SECONDS": "15"},
                                 {"RETEX_LEADER_RETRY_SECONDS": "9"},
                                 {"RETEX_LEADER_LEASE_SECONDS": "5"}])
def test_leader_election_timings_that_break_client_gos_rules_are_refused_before_start(env):
    assert "leader election" in refusal(DSN | env)


@pytest.mark.parametrize("name", ["RETEX_LEADER_LEASE_SECONDS", "RETEX_LEADER_RENEW_DEADLINE_SECONDS",
                                  "RETEX_LEADER_RETRY_SECONDS"])
def test_a_leader_election_value_that_is_not_a_positive_number_is_refused_by_name(name):
    assert refusal(DSN | {name: "ten"}) == f"{name}='ten' is not a number"
    assert name in refusal(DSN | {name: "-1"})


@pytest.mark.parametrize("timing", [ElectionTiming(), ElectionTiming(lease_duration=4, renew_deadline=3, retry_period=0.5)])
def test_the_operators_ledger_sessions_end_an_idle_transaction_and_a_lock_wait_at_the_renew_deadline(timing):
    limits = session_limits(timing)
    assert limits == SessionLimits(idle_in_transaction_seconds=timing.renew_deadline,
                                   lock_timeout_seconds=timing.renew_deadline)
    # A frozen leader's idle transaction is gone by the time a standby may take the Lease (D after
    # the last renewal); one whose statement waited for a lock, R later.
    assert limits.idle_in_transaction_seconds < timing.lease_duration
    assert limits.settings()["idle_in_transaction_session_timeout"] == f"{round(timing.renew_deadline * 1000)}ms"
    assert limits.settings()["lock_timeout"] == f"{round(timing.renew_deadline * 1000)}ms"


def test_the_ca_handed_to_workers_follows_the_file_and_an_unreadable_file_keeps_the_last_one(tls_files):
    settings = OperatorSettings.from_env(SECURE_DSN | tls_files)
    live = LiveWorkerDefaults(settings.worker, settings.ledger_tls)
    ca_file = tls_files["RETEX_LEDGER_CA_FILE"]
    with open(ca_file, "w") as rotated:
        rotated.write("-----BEGIN rotated ca.crt-----\n")
    assert live().ledger_ca == "-----BEGIN rotated ca.crt-----\n"
    assert live().image == settings.worker.image  # only the CA is read again
    os.remove(ca_file)  # mid-rotation
    assert live().ledger_ca == "-----BEGIN rotated ca.crt-----\n"
