"""The operator's probes: the pure readiness and liveness decisions (loop states, times, a Postgres
check's result → an answer and its reason), and the endpoint serving them (/readyz, /livez,
/healthz as /livez's alias, 404 elsewhere; the body names the reason)."""

import urllib.error
import urllib.request

import pytest

from e2e.postgres import free_port
from retex.operator.health import (
    MIN_STALE_SECONDS,
    OK,
    LoopState,
    Verdict,
    liveness,
    readiness,
    serve_health,
    term_overdue,
)

NOW = 10_000.0
FLOOR = 180.0


def loop(name="relay", period=2.0, started=None, passed=NOW - 1.0) -> LoopState:
    return LoopState(name=name, period=period, round_started_at=started, last_pass_at=passed)


def ready(**overrides) -> Verdict:
    args = {"postgres_error": None, "dead_threads": [], "endpoint_serving": True, "leading": True,
            "loops": [loop()], "now": NOW, "waiting_for_term": None, "lease_duration": 15.0}
    return readiness(**{**args, **overrides})


def live(**overrides) -> Verdict:
    args = {"dead_threads": [], "loops": [loop()], "now": NOW, "wedge_floor": FLOOR}
    return liveness(**{**args, **overrides})


def test_a_healthy_leader_is_ready_and_live():
    assert ready() == OK
    assert live() == OK


def test_postgres_unreachable_makes_a_replica_unready_and_says_so_but_leaves_it_live():
    verdict = ready(postgres_error="PoolTimeout: couldn't get a connection after 2.00 sec")
    assert not verdict.ok and verdict.reason.startswith("postgres unreachable: PoolTimeout")
    assert not ready(postgres_error="refused", leading=False).ok, "a standby too: workers call it"
    assert live() == OK  # liveness takes no Postgres answer at all: an outage cannot restart us


def test_a_dead_thread_makes_a_replica_unready_and_not_live():
    assert ready(dead_threads=["ledger-listen"]) == Verdict(False, "thread(s) dead: ledger-listen")
    assert live(dead_threads=["relay"]) == Verdict(False, "thread(s) dead: relay")


def test_a_dead_lease_watch_thread_fails_both_probes_on_a_standby_too():
    # The reaper is blind for good without it, and a standby becomes the leader with what it saw.
    dead = Verdict(False, "thread(s) dead: lease-watch")
    assert live(dead_threads=["lease-watch"]) == dead
    assert ready(dead_threads=["lease-watch"], leading=False) == dead


def test_a_dead_ledger_endpoint_server_makes_a_replica_unready():
    assert ready(endpoint_serving=False) == Verdict(False, "the ledger endpoint's server thread is dead")
    assert ready(endpoint_serving=False, leading=False).ok is False


def test_a_leader_whose_writer_loop_completed_no_round_for_three_periods_is_unready():
    period = 10.0
    assert ready(loops=[loop(period=period, passed=NOW - 3 * period + 1)]).ok
    stale = ready(loops=[loop(name="reaper", period=period, passed=NOW - 3 * period - 1)])
    assert not stale.ok and stale.reason.startswith("loop reaper has completed no round for 31s")


def test_a_short_period_loop_gets_the_minimum_before_it_counts_as_stale():
    assert ready(loops=[loop(period=0.1, passed=NOW - MIN_STALE_SECONDS + 1)]).ok
    assert not ready(loops=[loop(period=0.1, passed=NOW - MIN_STALE_SECONDS - 1)]).ok


def test_a_standby_whose_writer_loops_are_idle_by_design_is_ready():
    idle_for_an_hour = loop(passed=NOW - 3600)
    assert ready(leading=False, loops=[idle_for_an_hour]) == OK
    assert not ready(leading=True, loops=[idle_for_an_hour]).ok


def test_a_stale_loop_is_not_a_liveness_failure():
    assert live(loops=[loop(passed=NOW - 3600)]) == OK


def test_a_round_running_past_ten_periods_plus_the_floor_is_wedged_and_not_live():
    period = 2.0
    limit = 10 * period + FLOOR
    assert live(loops=[loop(period=period, started=NOW - limit + 1)]) == OK
    wedged = live(loops=[loop(name="promoter", period=period, started=NOW - limit - 1)])
    assert wedged == Verdict(False, "loop promoter wedged: its round has run for 201s")


def test_a_round_as_long_as_the_ledgers_retry_window_is_not_wedged():
    # A Postgres outage blocks a round in the ledger's retries for up to 120 s (its default
    # window): that is below the floor, so the outage never reads as a wedge.
    assert live(loops=[loop(period=0.1, started=NOW - 130)]) == OK


@pytest.fixture
def endpoint():
    answers = {"ready": OK, "live": OK}
    port = free_port()
    server = serve_health(f"http://127.0.0.1:{port}", ready=lambda: answers["ready"], live=lambda: answers["live"])
    yield f"http://127.0.0.1:{port}", answers
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def test_readyz_and_livez_answer_apart_and_name_the_reason(endpoint):
    base, answers = endpoint
    assert get(f"{base}/readyz") == (200, "ok\n")
    answers["ready"] = Verdict(False, "postgres unreachable: refused")
    assert get(f"{base}/readyz") == (503, "postgres unreachable: refused\n")
    assert get(f"{base}/livez") == (200, "ok\n")
    answers["live"] = Verdict(False, "loop relay wedged: its round has run for 300s")
    assert get(f"{base}/livez") == (503, "loop relay wedged: its round has run for 300s\n")


def test_healthz_is_an_alias_of_livez(endpoint):
    base, answers = endpoint
    answers["ready"] = Verdict(False, "postgres unreachable: refused")
    assert get(f"{base}/healthz") == (200, "ok\n")
    answers["live"] = Verdict(False, "thread(s) dead: relay")
    assert get(f"{base}/healthz")[0] == 503


def test_any_other_path_is_not_found(endpoint):
    base, _ = endpoint
    assert get(f"{base}/metrics")[0] == 404


def test_a_leader_waiting_a_lease_duration_for_the_ledgers_term_is_unready_and_gives_the_lease_up():
    """Postgres away from this replica only, or an old leader's long transaction holding the
    term's row: its writer loops idle as a standby's, so only this says it does not lead."""
    assert ready(waiting_for_term=5.0) == OK
    verdict = ready(waiting_for_term=15.0)
    assert not verdict.ok and "without the ledger's leadership term for 15s" in verdict.reason
    assert ready(waiting_for_term=None, leading=False) == OK  # a standby waits for no term
    assert not term_overdue(5.0, lease_duration=15.0) and not term_overdue(None, lease_duration=15.0)
    assert term_overdue(15.0, lease_duration=15.0)
