"""The status mirror's decisions, driven with small fakes of the ledger and the API calls (what
status it computes is tests/unit/test_status.py's): it writes only when the ledger is ahead of the
version shown, never onto another Task, keeps the marks of a failed round, resyncs only the Tasks
that lag, keeps the dead-letter label in step, posts a task's final Event whatever the limiter
says, shows a refusal once per generation, shows how long its oldest unwritten change has
waited (growing while every write is refused), lets go of a mark whose task was purged, and
writes a round's tasks `WRITERS` at a time."""

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from retex.kube.errors import api_message
from retex.kube.operator_calls import EVENT_MESSAGE_MAX, EventNotPosted, NotLeading, StatusNotWritten
from retex.ledger import LedgerUnavailable, TaskNotFound
from retex.machine import TaskPhase
from retex.operator.events import EVENT_POST_TRIES
from retex.operator.metrics import REGISTRY
from retex.operator.mirror import SAME_PHASE_WRITE_FLOOR_SECONDS, WRITE_BATCH, WRITERS, StatusMirror
from retex.operator.status import DEAD_LETTER_LABEL, in_fair_order
from tests.unit.test_kube_status_calls import invalid
from tests.unit.test_status import record


def rec(uid, **extra):
    return record(uid=uid, name=f"t-{uid}", **extra)


def task_object(uid, *, shown_version=None, labels=None, name=None):
    return {"apiVersion": "retex.dev/v1alpha1", "kind": "Task",
            "metadata": {"uid": uid, "name": name or f"t-{uid}", "namespace": "ns", "generation": 1,
                         "labels": labels or {}},
            "status": {} if shown_version is None else {"ledgerVersion": shown_version}}


class FakeLedger:
    def __init__(self, *records):
        self.records = {r.uid: r for r in records}
        self.read = []

    def get(self, uid):
        self.read.append(uid)
        if uid not in self.records:
            raise TaskNotFound(uid)
        return self.records[uid]

    def versions(self):
        return {uid: r.version for uid, r in self.records.items()}

    def dead_lettered_uids(self):
        return {uid for uid, r in self.records.items() if r.dead_lettered}

    def phases_of(self, uids):
        return {uid: (self.records[uid].namespace, self.records[uid].phase) for uid in uids if uid in self.records}

    def freeze(self, uid, *, reason, witness, shown_version):
        """As retex.ledger.witness.freeze: only when the version shown is past the ledger's."""
        held = self.records[uid]
        if held.frozen_reason is None and shown_version > held.version:
            self.records[uid] = replace(held, frozen_reason=reason, witness=witness,
                                        version=max(held.version, shown_version) + 1)
        return self.records[uid]


class FakeKube:
    def __init__(self, *tasks, patch_error=None, event_error=None, label_error=None):
        self.tasks = {t["metadata"]["name"]: t for t in tasks}
        self.patch_error, self.event_error, self.label_error = patch_error, event_error, label_error
        self.written, self.labels, self.events = [], [], []
        self.event_attempts = []
        self.statuses = []  # every status patch as sent

    def get_task(self, namespace, name):
        return self.tasks.get(name)

    def list_tasks(self):
        yield from list(self.tasks.values())  # KubeCalls.list_tasks pages lazily: nothing is read until iterated

    def patch_task_status(self, namespace, name, uid, status):
        if self.patch_error and self.patch_error[0] == uid:
            raise self.patch_error[1]
        self.written.append((uid, status.get("ledgerVersion"), status.get("phase")))
        self.statuses.append(status)
        if name in self.tasks:
            self.tasks[name]["status"] = status  # what the next GET shows

    def patch_task_labels(self, namespace, name, uid, labels):
        if self.label_error:
            raise self.label_error
        self.labels.append((uid, labels))

    def post_event(self, task, *, reason, message, warning):
        self.event_attempts.append(reason)
        if self.event_error:
            raise self.event_error
        self.events.append(reason)


NO_LEASES = SimpleNamespace(get=lambda namespace, name, uid: None)


def mirror(ledger, kube):
    return StatusMirror(ledger, kube, NO_LEASES, resync_seconds=3600)


def posted(m, kube):
    """The Events the poster has posted once it has posted all that is queued."""
    while m.events.round() == 0.0:
        pass
    return kube.events


def resync_and_write(m):
    """A round of the resync loop, then one of the writes."""
    m.resync.round()
    return m.round()


@pytest.mark.parametrize("shown, written", [(None, True), (6, True), (7, False)])
def test_a_status_is_written_only_when_the_ledger_is_ahead_of_the_version_shown(shown, written):
    """(A status ahead of the ledger freezes the task: the tests of freezing below.)"""
    kube = FakeKube(task_object("u", shown_version=shown))
    mirror(FakeLedger(rec("u", version=7)), kube).mirror("u")
    assert kube.written == ([("u", 7, "Running")] if written else [])


@pytest.mark.parametrize("task", [None, task_object("other-uid", name="t-u")], ids=["gone", "a-new-task-with-its-name"])
def test_nothing_is_written_onto_a_task_that_is_gone_or_is_another_with_its_name(task):
    kube = FakeKube(*([task] if task else []))
    m = mirror(FakeLedger(rec("u")), kube)
    m.mirror("u")
    assert kube.written == [] and posted(m, kube) == []


@pytest.mark.parametrize("code", [404, 409, 422])
def test_a_write_refused_as_gone_replaced_or_older_than_shown_is_let_go(code):
    kube = FakeKube(task_object("u"), patch_error=("u", StatusNotWritten(code)))
    m = mirror(FakeLedger(rec("u")), kube)
    m.mirror("u")  # does not raise: nothing to retry
    assert posted(m, kube) == []


def test_a_round_the_ledger_fails_keeps_the_marks_it_did_not_write_and_the_next_round_writes_them():
    ledger = FakeLedger(rec("u1"), rec("u2"), rec("u3"))
    kube = FakeKube(*(task_object(u, shown_version=7) for u in ("u1", "u2", "u3")))
    m = mirror(ledger, kube)
    for uid in ("u1", "u2", "u3"):  # the ledger moved on: each is now ahead of what is shown
        ledger.records[uid] = replace(ledger.records[uid], version=8)
        m.mark(uid)
    get = ledger.get
    ledger.get = lambda uid: (_ for _ in ()).throw(LedgerUnavailable("postgres down")) if uid == "u2" else get(uid)
    with pytest.raises(LedgerUnavailable):  # the ledger fails every task alike: the round fails
        m.round()
    ledger.get = get
    m.round()
    assert sorted(uid for uid, _, _ in kube.written) == ["u1", "u2", "u3"], "each written once, none lost"


@pytest.mark.parametrize("error", [ApiException(status=403, reason="Forbidden"),
                                   ApiException(status=500, reason="etcdserver: request timed out"),
                                   ApiException(status=400, reason="Bad Request")], ids=["403", "500", "400"])
def test_a_task_whose_status_write_keeps_failing_holds_up_no_other_tasks_write(error):
    now = [1000.0]
    ledger = FakeLedger(rec("u1"), rec("u2"), rec("u3"))
    kube = FakeKube(*(task_object(u, shown_version=6) for u in ("u1", "u2", "u3")), patch_error=("u2", error))
    m = StatusMirror(ledger, kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    errors_before = REGISTRY.get_sample_value("retex_reconcile_errors_total", {"loop": "status-mirror"}) or 0
    for uid in ("u1", "u2", "u3"):
        m.mark(uid)
    m.round()  # does not raise: u2's failure is u2's
    assert sorted(uid for uid, _, _ in kube.written) == ["u1", "u3"]
    assert REGISTRY.get_sample_value("retex_reconcile_errors_total", {"loop": "status-mirror"}) == errors_before + 1
    ledger.records["u1"] = replace(ledger.records["u1"], version=8, phase=TaskPhase.SUCCEEDED)
    m.mark("u1")
    m.round()  # u2 waits out its backoff: not tried again at once
    assert [uid for uid, _, _ in kube.written][2:] == ["u1"]
    assert REGISTRY.get_sample_value("retex_reconcile_errors_total", {"loop": "status-mirror"}) == errors_before + 1
    assert pending_seconds() == 0, "u2 marked at the same clock reading"
    now[0] += 30
    assert pending_seconds() == 30, "the refused task's change shows as pending"
    kube.patch_error = None
    m.round()
    assert [uid for uid, _, _ in kube.written][3:] == ["u2"] and pending_seconds() == 0


@pytest.mark.parametrize("error, level", [
    (invalid(("FieldValueTooLong", "Too long: may not be more than 4096 bytes", "status.lastError")), logging.ERROR),
    (ApiException(status=403, reason="Forbidden"), logging.ERROR),
    (ApiException(status=500, reason="etcdserver: request timed out"), logging.WARNING),
], ids=["422-schema", "403", "500"])
def test_a_failed_status_write_is_logged_with_the_api_servers_words_as_an_error_unless_it_may_clear_by_itself(
        error, level, caplog):
    """A refusal that lasts until someone acts (a status the CRD refuses, a RoleBinding removed) is
    an error; a server error or a dropped connection may clear by itself."""
    kube = FakeKube(task_object("u", shown_version=6), patch_error=("u", error))
    with caplog.at_level(logging.INFO, logger="retex.operator.mirror"):
        resync_and_write(mirror(FakeLedger(rec("u", version=7)), kube))
    [line] = [r for r in caplog.records if r.getMessage() == "status write failed; retrying"]
    assert line.levelno == level
    assert line.fields["http_status"] == error.status and line.fields["message"] == api_message(error)


def pending_seconds() -> float | None:
    return REGISTRY.get_sample_value("retex_status_mirror_oldest_pending_seconds")


def test_a_mirror_whose_patches_the_api_server_refuses_shows_its_oldest_pending_change_growing():
    now = [1000.0]
    kube = FakeKube(task_object("u", shown_version=6),
                    patch_error=("u", ApiException(status=403, reason="Forbidden")))
    m = StatusMirror(FakeLedger(rec("u", version=7)), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    assert pending_seconds() == 0
    m.mark("u")
    for waited in (30.0, 60.0, 90.0):
        now[0] += 30
        m.round()  # every round's patch is refused
        assert pending_seconds() == waited  # a stalled mirror writes nothing, yet shows it waits
    assert kube.written == []
    m.may_write = lambda: False
    assert pending_seconds() == 0, "a standby writes nothing by design: nothing waits on it"
    m.may_write = lambda: True
    kube.patch_error = None
    now[0] += 60  # past its backoff
    m.round()
    assert kube.written == [("u", 7, "Running")] and pending_seconds() == 0


def test_at_takeover_the_pending_gauge_starts_from_the_takeover_not_from_what_the_standby_heard():
    # The ledger-listen thread runs on a standby too: what it hears an hour before leading must
    # not show as an hour-old unwritten change the moment it leads (RetexStatusMirrorLagHigh).
    now = [1000.0]
    ledger = FakeLedger(rec("u", version=7))
    kube = FakeKube(task_object("u", shown_version=6))
    m = StatusMirror(ledger, kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    m.may_write = lambda: False
    m.mark("u")  # heard as a standby
    now[0] += 3600
    m.may_write = lambda: True  # takes over: what Runtime._lead does, under the election lock
    m.take_over()
    assert pending_seconds() == 0
    now[0] += 5
    resync_and_write(m)  # the takeover's resync marks the lagging task, and the next round writes it
    assert kube.written == [("u", 7, "Running")] and pending_seconds() == 0


def test_marks_a_leader_kept_when_it_stopped_leading_wait_from_its_next_takeover():
    now = [1000.0]
    kube = FakeKube(task_object("u", shown_version=6),
                    patch_error=("u", ApiException(status=500, reason="etcdserver: request timed out")))
    m = StatusMirror(FakeLedger(rec("u", version=7)), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    m.mark("u")
    m.round()  # refused: "u" stays marked
    m.may_write = lambda: False  # lost the election with "u" unwritten
    now[0] += 3600
    m.may_write = lambda: True
    m.take_over()
    now[0] += 5
    assert pending_seconds() == 5


def test_a_mark_dropped_as_leadership_ended_does_not_show_as_pending_once_it_leads_again():
    """The round under way when this replica stopped leading re-marks what it did not write, and a
    standby keeps no marks; if the next leader wrote the Task meanwhile, no resync marks it again,
    and its old first-mark time must not stay behind as an ever older pending change."""
    now = [1000.0]
    kube = FakeKube(task_object("u", shown_version=6))
    m = StatusMirror(FakeLedger(rec("u", version=7)), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])

    def patch_and_find_the_leadership_gone(namespace, name, uid, status):
        m.may_write = lambda: False
        raise NotLeading(f"patch Task {name}")

    kube.patch_task_status = patch_and_find_the_leadership_gone
    m.mark("u")
    with pytest.raises(NotLeading):
        m.round()
    kube.tasks["t-u"]["status"] = {"ledgerVersion": 7}  # the other leader wrote it
    now[0] += 3600
    m.may_write = lambda: True
    m.take_over()
    resync_and_write(m)
    now[0] += 10
    assert pending_seconds() == 0


@pytest.mark.parametrize("shown", [7, "gone"])
def test_a_mark_with_nothing_to_write_waits_no_longer(shown):
    now = [1000.0]
    kube = FakeKube(*([task_object("u", shown_version=shown)] if shown != "gone" else []))
    m = StatusMirror(FakeLedger(rec("u", version=7)), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    m.mark("u")
    now[0] += 30
    m.round()
    assert kube.written == [] and pending_seconds() == 0


def test_a_mark_for_a_task_the_ledger_no_longer_holds_is_let_go_and_holds_up_no_other():
    # Purged by the history retention after it was marked (e.g. a mark a failed round kept).
    kube = FakeKube(task_object("u", shown_version=6))
    m = mirror(FakeLedger(rec("u", version=7)), kube)
    m.mark("purged")
    m.mark("u")
    m.round()
    assert kube.written == [("u", 7, "Running")] and pending_seconds() == 0  # none waits: "purged" too


def test_the_resync_marks_only_the_tasks_whose_shown_version_lags_the_ledger():
    ledger = FakeLedger(rec("behind", version=7), rec("current", version=7))
    refused = task_object("refused")  # never admitted: not in the ledger
    kube = FakeKube(task_object("behind", shown_version=6), task_object("current", shown_version=7), refused)
    resync_and_write(mirror(ledger, kube))
    assert ledger.read == ["behind"], "only the lagging Task is marked"
    assert [uid for uid, _, _ in kube.written] == ["behind"]


def written_then_a_step_done(now):
    """A Running task's status written, then a step of it done (its phase unchanged) and marked."""
    ledger = FakeLedger(rec("u", version=7))
    kube = FakeKube(task_object("u", shown_version=6))
    m = StatusMirror(ledger, kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    m.mark("u")
    m.round()
    ledger.records["u"] = rec("u", version=8, states=("done", "done", "started"))
    m.mark("u")
    return ledger, kube, m


def test_a_tasks_status_is_written_at_most_once_a_floor_while_its_phase_stays_and_a_phase_change_at_once():
    """A task of many quick steps moves its ledger version at every step: one status write per
    step is API-server load no dashboard needs."""
    now = [1000.0]
    ledger, kube, m = written_then_a_step_done(now)
    now[0] += SAME_PHASE_WRITE_FLOOR_SECONDS / 2
    m.round()
    assert kube.written == [("u", 7, "Running")], "the next step's status waits for the floor"
    now[0] += SAME_PHASE_WRITE_FLOOR_SECONDS / 2
    m.round()
    assert kube.written == [("u", 7, "Running"), ("u", 8, "Running")], "written once the floor has passed"
    ledger.records["u"] = rec("u", phase=TaskPhase.SUCCEEDED, version=9, states=("done",) * 3)
    m.mark("u")
    now[0] += 0.1
    m.round()
    assert kube.written[-1] == ("u", 9, "Succeeded"), "a phase change is written at once"


def test_a_phase_change_made_while_the_task_is_held_back_is_written_at_once():
    now = [1000.0]
    ledger, kube, m = written_then_a_step_done(now)
    now[0] += 0.5
    m.round()  # held back
    ledger.records["u"] = rec("u", phase=TaskPhase.SUCCEEDED, version=9, states=("done",) * 3)
    m.mark("u")
    now[0] += 0.1
    m.round()
    assert kube.written == [("u", 7, "Running"), ("u", 9, "Succeeded")]


def test_tasks_held_back_take_no_place_in_a_round_and_do_not_make_it_spin():
    """Many tasks of quick steps are held back at scale: they must not fill the round's batch ahead
    of a task whose phase changed, nor have the loop come round at once for nothing."""
    now = [1000.0]
    quick = [f"q{n}" for n in range(WRITE_BATCH + 4)]
    ledger = FakeLedger(*(rec(uid, version=7) for uid in quick), rec("done", version=7))
    kube = FakeKube(*(task_object(uid, shown_version=6) for uid in [*quick, "done"]))
    m = StatusMirror(ledger, kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    for uid in [*quick, "done"]:
        m.mark(uid)
    while m.round() == 0:
        pass
    for uid in quick:  # a step each, marked first: their marks are the oldest
        ledger.records[uid] = rec(uid, version=8, states=("done", "done", "started"))
        m.mark(uid)
    ledger.records["done"] = rec("done", phase=TaskPhase.SUCCEEDED, version=8, states=("done",) * 3)
    m.mark("done")
    now[0] += 0.1
    assert m.round() == m.COALESCE_SECONDS, "nothing more to write now: no round at once"
    assert kube.written[-1] == ("done", 8, "Succeeded")
    now[0] += SAME_PHASE_WRITE_FLOOR_SECONDS
    while m.round() == 0:
        pass
    assert sorted(uid for uid, version, _ in kube.written if version == 8) == sorted([*quick, "done"])


def test_a_resync_under_way_holds_up_no_status_write():
    """The resync's LIST of every Task takes seconds at scale: it runs on a loop of its own, and a
    change marked meanwhile is written at once."""
    ledger = FakeLedger(rec("changed", version=7), rec("other", version=7))
    kube = FakeKube(task_object("changed", shown_version=6), task_object("other", shown_version=6))
    listing, listed = threading.Event(), threading.Event()
    pages = kube.list_tasks

    def a_slow_list():
        listing.set()
        assert listed.wait(5), "the test never let the LIST end"
        yield from pages()

    kube.list_tasks = a_slow_list
    m = mirror(ledger, kube)
    resync = threading.Thread(target=m.resync.round, daemon=True)
    resync.start()
    assert listing.wait(5)
    m.mark("changed")
    writes = threading.Thread(target=m.round, daemon=True)
    writes.start()
    writes.join(5)
    try:
        assert not writes.is_alive(), "the round waited for the resync"
        assert kube.written == [("changed", 7, "Running")]
    finally:
        listed.set()
    resync.join(5)
    m.round()
    assert [uid for uid, _, _ in kube.written] == ["changed", "other"], "what the resync found, written next"


def frozen_lines(caplog):
    return [r for r in caplog.records if r.getMessage() == "task frozen: the ledger is behind the Task's status"]


def test_a_task_whose_status_is_ahead_of_the_ledger_is_frozen_and_shown_ledger_behind_once(caplog):
    """A shown ledgerVersion above the ledger's: the ledger forgot commits it acknowledged (or was
    restored from an older backup), and steps it forgot would run again. The resync freezes it; its
    status then says so (what it showed kept), with one Warning Event and one ERROR line."""
    ledger = FakeLedger(rec("ahead", version=5), rec("current", version=7))
    kube = FakeKube(task_object("ahead", shown_version=9), task_object("current", shown_version=7))
    kube.tasks["t-ahead"]["status"]["phase"] = "Succeeded"
    m = mirror(ledger, kube)
    with caplog.at_level(logging.ERROR, logger="retex.operator.mirror"):
        resync_and_write(m)
        resync_and_write(m)
    assert ledger.records["ahead"].frozen_reason == "LedgerBehind" and ledger.records["ahead"].version == 10
    assert kube.written == [("ahead", 10, "LedgerBehind")], "written once, past the version shown"
    assert posted(m, kube) == ["LedgerBehind"]
    assert len(frozen_lines(caplog)) == 1
    assert ledger.records["current"].frozen_reason is None


def test_the_mirror_freezes_a_task_it_finds_ahead_of_the_ledger_without_waiting_for_a_resync():
    ledger = FakeLedger(rec("ahead", version=5))
    kube = FakeKube(task_object("ahead", shown_version=9))
    m = mirror(ledger, kube)
    m.mark("ahead")
    m.round()
    assert ledger.records["ahead"].frozen_reason == "LedgerBehind"
    assert kube.written == [("ahead", 10, "LedgerBehind")]


def test_a_resync_hands_on_the_tasks_the_ledger_lost_and_only_those_when_asked():
    ledger = FakeLedger(rec("held", version=3))
    kube = FakeKube(task_object("held", shown_version=3), task_object("lost", shown_version=8),
                    task_object("new"))
    m = mirror(ledger, kube)
    handed: list[str] = []
    m.mark_behind(lost=lambda task: handed.append(task["metadata"]["uid"]))
    m.mark_behind()
    assert handed == ["lost"], "shown admitted, not held; a Task never shown admitted is admission's"


def test_a_restore_that_puts_many_tasks_behind_freezes_them_all_in_one_resync():
    count = 3 * WRITE_BATCH
    ledger = FakeLedger(*(rec(f"u{n}", version=1) for n in range(count)))
    kube = FakeKube(*(task_object(f"u{n}", shown_version=4) for n in range(count)))
    mirror(ledger, kube).resync.round()
    assert all(r.frozen_reason == "LedgerBehind" for r in ledger.records.values())


def test_a_status_written_while_the_resync_reads_is_not_taken_for_a_ledger_behind_it():
    """The resync lists the Tasks before it reads the ledger's versions: a status written between
    the two (a replica handing over) is then never newer than the versions read."""
    ledger = FakeLedger(rec("u", version=5))
    kube = FakeKube(task_object("u", shown_version=5))
    listed = kube.list_tasks

    def a_write_lands_meanwhile():  # as the first page is fetched
        ledger.records["u"] = rec("u", version=6)
        kube.tasks["t-u"]["status"] = {"ledgerVersion": 6}
        yield from listed()

    kube.list_tasks = a_write_lands_meanwhile
    resync_and_write(mirror(ledger, kube))
    assert ledger.records["u"].frozen_reason is None and kube.events == []


def test_the_resync_marks_a_task_whose_dead_letter_label_disagrees_though_its_status_is_current():
    """A label patch lost as the leader stopped leading (its mark dropped): the next leader's
    resync must find it, or `kubectl get tasks -l retex.dev/dead-letter=true` misses it for good."""
    dead = rec("dead", phase=TaskPhase.FAILED, dead_lettered=True, version=7)
    requeued = rec("requeued", phase=TaskPhase.RUNNING, dead_lettered=False, version=7)
    kube = FakeKube(task_object("dead", shown_version=7),
                    task_object("requeued", shown_version=7, labels={DEAD_LETTER_LABEL: "true"}))
    resync_and_write(mirror(FakeLedger(dead, requeued), kube))
    assert sorted(kube.labels) == [("dead", {DEAD_LETTER_LABEL: "true"}), ("requeued", {DEAD_LETTER_LABEL: None})]
    assert kube.written == [], "the statuses were current"


@pytest.mark.parametrize("dead_lettered, label, patched", [
    (True, None, {DEAD_LETTER_LABEL: "true"}),
    (False, "true", {DEAD_LETTER_LABEL: None}),  # requeued: the label goes
    (True, "true", None),
    (False, None, None),
])
def test_the_dead_letter_label_follows_the_ledger(dead_lettered, label, patched):
    phase = TaskPhase.FAILED if dead_lettered else TaskPhase.RUNNING
    kube = FakeKube(task_object("u", labels={DEAD_LETTER_LABEL: label} if label else {}))
    mirror(FakeLedger(rec("u", phase=phase, dead_lettered=dead_lettered)), kube).mirror("u")
    assert kube.labels == ([("u", patched)] if patched else [])


def test_a_dead_letter_label_patch_that_failed_is_patched_at_the_next_round_though_the_status_is_current():
    # The runbook's `kubectl get tasks -l retex.dev/dead-letter=true` must not miss it for good.
    dead = rec("u", phase=TaskPhase.FAILED, dead_lettered=True, reason="RetriesExhausted", last_error="exit 1")
    kube = FakeKube(task_object("u", shown_version=6),
                    label_error=ApiException(status=500, reason="etcdserver: request timed out"))
    now = [1000.0]
    m = StatusMirror(FakeLedger(dead), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    m.mark("u")
    m.round()
    assert kube.written == [("u", 7, "Failed")] and kube.labels == [], "the fault fired: the status landed, the label did not"
    events_before_the_label = list(posted(m, kube))
    kube.label_error = None
    now[0] += 60  # past its backoff
    m.round()  # the round's kept mark: the status is current now, the label still wrong
    assert kube.labels == [("u", {DEAD_LETTER_LABEL: "true"})]
    assert kube.written == [("u", 7, "Failed")] and posted(m, kube).count("Failed") == 1
    assert "Failed" in events_before_the_label, "the task's final Event is not held up by its label"


def test_the_event_of_a_tasks_end_is_posted_even_when_its_attempt_events_spent_the_limit():
    # A crash-looping task first seen at attempt 12, already Failed: 14 Events, the limit is 10.
    failed = rec("u", phase=TaskPhase.FAILED, epoch=12, reason="RetriesExhausted", last_error="exit 1")
    kube = FakeKube(task_object("u"))
    m = mirror(FakeLedger(failed), kube)
    m.mirror("u")
    assert posted(m, kube) == ["Accepted", *["AttemptStarted"] * 9, "Failed"]


def test_a_refused_task_is_completed_with_reason_refused():
    # It never runs: `kubectl wait --for=condition=Completed` must return for it too.
    kube = FakeKube()
    mirror(FakeLedger(), kube).refuse(task_object("u"), "InvalidSpec", "spec.steps: at least 1 item")
    conditions = {c["type"]: c for c in kube.statuses[-1]["conditions"]}
    assert (conditions["Completed"]["status"], conditions["Completed"]["reason"]) == ("True", "Refused")
    assert conditions["Completed"]["message"] == "InvalidSpec: spec.steps: at least 1 item"


def test_a_refusal_shown_without_completed_gets_it_at_the_next_admission_without_a_second_event():
    # Refused by an operator that did not write Completed: the restarted operator adds it.
    kube = FakeKube()
    task = {**task_object("u"), "status": {"phase": "Refused", "observedGeneration": 1, "conditions": [
        {"type": "Accepted", "status": "False", "reason": "InvalidSpec", "message": "too big",
         "observedGeneration": 1, "lastTransitionTime": "2026-12-03T09:00:00Z"}]}}
    mirror(FakeLedger(), kube).refuse(task, "InvalidSpec", "too big")
    assert [c["type"] for c in kube.statuses[-1]["conditions"]] == ["Accepted", "Completed"]
    assert kube.events == []


def test_a_refusal_is_written_and_announced_once_per_generation():
    kube = FakeKube()
    m = mirror(FakeLedger(), kube)
    task = task_object("u")
    m.refuse(task, "InvalidSpec", "steps: at least one")
    assert [(uid, phase) for uid, _, phase in kube.written] == [("u", "Refused")]
    assert kube.events == ["InvalidSpec"]
    shown = {**task, "status": kube.statuses[-1]}
    m.refuse(shown, "InvalidSpec", "steps: at least one")  # admission again: an operator restart
    assert len(kube.written) == 1 and kube.events == ["InvalidSpec"]
    m.refuse({**shown, "metadata": {**shown["metadata"], "generation": 2}}, "InvalidSpec", "steps: at least one")
    assert len(kube.written) == 2 and kube.events == ["InvalidSpec", "InvalidSpec"]


def test_a_backlog_of_waiting_tasks_is_written_in_short_rounds_and_a_running_tasks_change_goes_first():
    """5,000 Tasks delayed by notBefore each need a first status: a change of a task that is doing
    something (marked after all of them) must not wait behind that backlog (it waited 115 s at scale)."""
    now = [1000.0]
    waiting = [f"w{i}" for i in range(3 * WRITE_BATCH)]
    ledger = FakeLedger(*(rec(uid, phase=TaskPhase.SCHEDULED) for uid in waiting), rec("busy"))
    kube = FakeKube(*(task_object(uid) for uid in [*waiting, "busy"]))
    m = StatusMirror(ledger, kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    for uid in waiting:
        m.mark(uid)
        now[0] += 0.01
    m.mark("busy")
    assert m.round() == 0, "more to write: the next round at once"
    assert len(kube.written) == WRITE_BATCH, "one short round, then the marks are ordered again"
    # Written `WRITERS` at a time: the round's tasks, not the order they finished in.
    assert {uid for uid, _, _ in kube.written} == {"busy", *waiting[:WRITE_BATCH - 1]}, "then the oldest marks first"
    while m.round() == 0:
        pass
    assert sorted(uid for uid, _, _ in kube.written) == sorted([*waiting, "busy"]), "each written once"


def written_in_one_round(ledger, kube, marked: list[str]) -> list[str]:
    """The tasks one round of a mirror writes, in order, after `marked` were marked 10 ms apart."""
    now = [1000.0]
    m = StatusMirror(ledger, kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    for uid in marked:
        m.mark(uid)
        now[0] += 0.01
    m.round()
    return [uid for uid, _, _ in kube.written]


def test_a_rounds_writes_are_handed_out_most_urgent_first(monkeypatch):
    monkeypatch.setattr("retex.operator.mirror.WRITERS", 1)  # one writer: the hand-out order is the write order
    waiting = [f"w{i}" for i in range(2 * WRITE_BATCH)]
    ledger = FakeLedger(*(rec(uid, phase=TaskPhase.SCHEDULED) for uid in waiting), rec("busy"))
    kube = FakeKube(*(task_object(uid) for uid in [*waiting, "busy"]))
    assert written_in_one_round(ledger, kube, [*waiting, "busy"]) == ["busy", *waiting[:WRITE_BATCH - 1]]


def test_the_write_order_takes_the_namespaces_in_turn_tasks_doing_something_first_oldest_mark_first():
    phases = {"a1": ("a", TaskPhase.RUNNING), "a2": ("a", TaskPhase.QUEUED), "a3": ("a", TaskPhase.RUNNING),
              "a4": ("a", TaskPhase.SCHEDULED), "b1": ("b", TaskPhase.RUNNING), "b2": ("b", TaskPhase.SCHEDULED),
              "c1": ("c", TaskPhase.RETRYING)}
    marked_at = {"a1": 1.0, "a2": 2.0, "a3": 3.0, "a4": 0.5, "b1": 4.0, "b2": 0.1, "c1": 3.5, "gone": 0.2}
    order = in_fair_order(list(marked_at), phases, marked_at)
    # Round by round: each namespace's next task, the namespaces by the mark of that task; a task
    # the ledger no longer holds takes turns with the others (its write finds nothing to write).
    assert order == ["gone", "a1", "c1", "b1", "a2", "a3", "b2", "a4"]


def test_a_tenant_with_thousands_of_marks_holds_up_another_tenants_status_by_one_write(monkeypatch):
    monkeypatch.setattr("retex.operator.mirror.WRITERS", 1)  # one writer: the hand-out order is the write order
    noisy = [f"a{i}" for i in range(3 * WRITE_BATCH)]
    ledger = FakeLedger(*(rec(uid, namespace="tenant-a") for uid in noisy), rec("quiet", namespace="tenant-b"))
    kube = FakeKube(*(task_object(uid) for uid in [*noisy, "quiet"]))
    assert written_in_one_round(ledger, kube, [*noisy, "quiet"]) == ["a0", "quiet", *noisy[1:WRITE_BATCH - 1]]


def test_a_rounds_writes_run_side_by_side_so_a_slow_api_server_delays_a_change_by_one_write_not_by_the_round():
    """A write is several round trips to the API server, each 100-300 ms on a loaded one: one after
    another, a round of `WRITE_BATCH` took seconds, and a change waited for every write before it
    (on kind at scale, status lag p99 15.7 s). Here each patch waits until `WRITERS` are in flight."""
    uids = [f"u{n}" for n in range(2 * WRITERS)]
    kube = FakeKube(*(task_object(uid) for uid in uids))
    in_flight = threading.Barrier(WRITERS, timeout=5)
    patch = kube.patch_task_status

    def patch_alongside_the_others(namespace, name, uid, status):
        in_flight.wait()  # one write at a time breaks it: each write then fails, and is kept for later
        patch(namespace, name, uid, status)

    kube.patch_task_status = patch_alongside_the_others
    m = mirror(FakeLedger(*(rec(uid) for uid in uids)), kube)
    for uid in uids:
        m.mark(uid)
    m.round()
    assert sorted(uid for uid, _, _ in kube.written) == sorted(uids), "all written in the one round"


def test_a_round_that_fails_for_every_task_ends_its_writes_in_flight_starts_no_more_and_loses_no_mark():
    uids = [f"u{n}" for n in range(WRITE_BATCH)]  # one round's worth: a round that went on would write them all
    kube = FakeKube(*(task_object(uid) for uid in uids))
    first = threading.Barrier(WRITERS, timeout=5)  # the first patches, all in flight at once
    lock, patched = threading.Lock(), []
    patch = kube.patch_task_status

    def patch_and_find_the_leadership_gone(namespace, name, uid, status):
        with lock:
            patched.append(uid)
            nth = len(patched)
        if nth <= WRITERS:
            if first.wait() == WRITERS - 1:  # the last of them in finds this replica no longer leads
                raise NotLeading(f"patch Task {name}")
            time.sleep(0.1)  # the others are still in flight as it fails
        patch(namespace, name, uid, status)

    kube.patch_task_status = patch_and_find_the_leadership_gone
    m = mirror(FakeLedger(*(rec(uid) for uid in uids)), kube)
    for uid in uids:
        m.mark(uid)
    with pytest.raises(NotLeading):
        m.round()
    written = [uid for uid, _, _ in kube.written]
    assert len(written) >= WRITERS - 1, "the writes in flight finished before the round failed"
    assert len(written) < len(uids) - 1, "no more were started once it failed"
    while m.round() == 0:  # leading again: the next rounds write what the failed one did not
        pass
    assert sorted(uid for uid, _, _ in kube.written) == sorted(uids), "each written once, none lost"


def test_a_slow_event_post_holds_up_no_status_write():
    """An Event post is a round trip of its own (on the rig at scale 60 ms on average, 230 ms at
    p95): in the writers' path, every status change behind it waited for it."""
    uids = [f"u{n}" for n in range(2 * WRITERS)]
    kube = FakeKube(*(task_object(uid) for uid in uids))
    released, blocked = threading.Event(), []

    def post_when_released(task, *, reason, message, warning):
        blocked.append(reason)
        released.wait(10)
        kube.events.append(reason)

    kube.post_event = post_when_released
    m = mirror(FakeLedger(*(rec(uid) for uid in uids)), kube)
    for uid in uids:
        m.mark(uid)
    writes = threading.Thread(target=m.round, daemon=True)
    writes.start()
    writes.join(2)
    try:
        assert not writes.is_alive(), "the round waited for an Event post"
        assert sorted(uid for uid, _, _ in kube.written) == sorted(uids)
        poster = threading.Thread(target=lambda: posted(m, kube), daemon=True)
        poster.start()
        poster.join(2)
        assert blocked, "the fault fired: an Event post waits"
    finally:
        released.set()
    poster.join(5)
    assert kube.events.count("Accepted") == len(uids), "each task's Events posted on the poster's loop"


def queued_events(m, count, reason="AttemptStarted"):
    for n in range(count):
        m.events.put(task_object(f"u{n}"), reason, f"attempt {n}", False)


def events_dropped() -> float:
    return REGISTRY.get_sample_value("retex_events_dropped_total") or 0.0


def answered(status: int) -> EventNotPosted:
    """As KubeCalls.post_event raises it: the API server's answer as its cause."""
    error = EventNotPosted(status, "from the API server")
    error.__cause__ = ApiException(status=status)
    return error


def test_a_queued_event_wakes_the_poster_and_holds_only_what_names_its_task():
    m = mirror(FakeLedger(), FakeKube())
    task = {**task_object("u"), "spec": {"payload": "x" * 65536}}
    m.events.put(task, "Failed", "exit 1: " + "x" * 5000, True)  # a task's lastError: up to 4,096 characters
    assert m.events.wake.is_set(), "posted at once, not at the poster's next period"
    queued = m.events._queue[0]
    assert "spec" not in queued.task and queued.task["metadata"]["uid"] == "u"
    assert len(queued.message) == EVENT_MESSAGE_MAX, "queued as it will be posted"


def test_past_the_queues_capacity_an_event_is_dropped_and_counted_and_a_tasks_end_only_past_the_hard_one(
        monkeypatch, caplog):
    monkeypatch.setattr("retex.operator.events.EVENT_QUEUE_CAPACITY", 3)
    monkeypatch.setattr("retex.operator.events.EVENT_QUEUE_HARD_CAPACITY", 4)
    kube = FakeKube()
    m = mirror(FakeLedger(), kube)
    dropped = events_dropped()
    queued_events(m, 5)
    m.events.put(task_object("u8"), "NeedsAttention", "step notify awaits a human", True)
    m.events.put(task_object("u9"), "Succeeded", "task Succeeded", False)
    assert events_dropped() - dropped == 3
    assert posted(m, kube) == ["AttemptStarted"] * 3 + ["NeedsAttention"], "the first ones kept, and a task's wait"
    messages = [r.message for r in caplog.records]
    assert messages.count("event queue full: Events other than a task's end are dropped until it drains") == 1
    assert messages.count("event queue drained") == 1


def test_a_full_queue_that_keeps_draining_and_filling_logs_its_drops_once():
    # At capacity each post frees a place the next put takes: one line until it empties, not one a post.
    kube = FakeKube()
    m = mirror(FakeLedger(), kube)
    queued_events(m, 1000)
    dropped = events_dropped()
    logged = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("retex.operator.events.log_line", lambda logger, level, message, **fields: logged.append(message))
        for n in range(5):
            m.events.put(task_object(f"v{n}"), "AttemptStarted", "one too many", False)
            m.events._post_queued(iter([True, False]).__next__)  # one post frees one place
            m.events.put(task_object(f"w{n}"), "AttemptStarted", "takes the freed place", False)
    assert events_dropped() - dropped == 5
    assert logged.count("event queue full: Events other than a task's end are dropped until it drains") == 1


def test_after_a_post_that_may_succeed_later_the_poster_backs_off_a_new_event_does_not_cut_it_short_and_rounds_go_on(
        ):
    now = [1000.0]
    kube = FakeKube()
    m = StatusMirror(FakeLedger(), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    queued_events(m, 1)
    kube.event_error = answered(503)
    errors = REGISTRY.get_sample_value("retex_reconcile_errors_total", {"loop": "event-poster"})
    waits = []
    for _ in range(4):  # backoffs of 1, 2, 4, 8 s
        waits.append(m.events.round())
        m.events.put(task_object("new"), "AttemptStarted", "a change meanwhile", False)
        tried = len(kube.event_attempts)
        waits.append(m.events.round())  # woken by the put, within the backoff
        assert len(kube.event_attempts) == tried, "a new Event cut the backoff short"
        now[0] += 2 ** len(waits)
    assert max(waits) <= m.events.period, "a round at least every period: the readiness probe judges the loop by them"
    assert kube.event_attempts and kube.events == [], "the fault fired"
    assert REGISTRY.get_sample_value("retex_reconcile_errors_total", {"loop": "event-poster"}) > errors
    kube.event_error = None
    now[0] += 60
    assert posted(m, kube) == ["AttemptStarted"] * 5, "none lost"


def event_in(namespace, uid):
    task = task_object(uid)
    task["metadata"]["namespace"] = namespace
    return task


@pytest.mark.parametrize("failure", [answered(500), answered(429), urllib3.exceptions.ProtocolError("connection reset")],
                         ids=["webhook-500", "429", "no-answer"])
def test_a_namespace_whose_events_keep_failing_holds_up_no_other_and_its_events_are_dropped_after_their_tries(
        failure):
    # One namespace refusing Events for a while (its quota full, a webhook on Events down) must not
    # hold up the other namespaces' Events queued behind its own.
    now = [1000.0]
    kube = FakeKube()
    post = kube.post_event

    def post_unless_in_a(task, *, reason, message, warning):
        if task["metadata"]["namespace"] == "a":
            kube.event_attempts.append(reason)
            raise failure
        post(task, reason=reason, message=message, warning=warning)

    kube.post_event = post_unless_in_a
    m = StatusMirror(FakeLedger(), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    for n in range(20):
        m.events.put(event_in("a", f"a{n}"), "AttemptStarted", f"a {n}", False)
    m.events.put(event_in("b", "b0"), "Succeeded", "task Succeeded", False)
    dropped = events_dropped()
    assert m.events.round() <= m.events.period
    assert kube.events == ["Succeeded"], "b's Event posted in the first round, behind a's twenty"
    assert len(kube.event_attempts) == 2, "a tried once, then backing off: its other Events not tried"
    for _ in range(20 * EVENT_POST_TRIES):
        now[0] += 61  # past any backoff
        m.events.round()
    assert events_dropped() - dropped == 20 and m.events.round() == m.events.period, "a's dropped, counted"
    assert len(kube.event_attempts) == 1 + 20 * EVENT_POST_TRIES, "each of a's tried its tries, no more"


def test_an_event_in_flight_when_this_replica_takes_over_again_is_not_put_back():
    kube = FakeKube()
    m = mirror(FakeLedger(), kube)
    queued_events(m, 2)

    def lead_again_then_fail(task, *, reason, message, warning):
        kube.event_attempts.append(reason)
        m.take_over()
        raise answered(503)

    kube.post_event = lead_again_then_fail
    dropped = events_dropped()
    m.events.round()
    assert kube.event_attempts == ["AttemptStarted"], "the fault fired"
    assert events_dropped() - dropped == 2 and m.events._queue == deque(), "both forgotten, counted, not queued"


def test_events_left_when_the_drain_at_stop_ends_are_counted_as_dropped():
    kube = FakeKube()
    m = mirror(FakeLedger(), kube)
    queued_events(m, 3)
    m.events.may_write = lambda: False  # the drain posts nothing: it no longer leads
    dropped = events_dropped()
    m.events.drain()
    assert kube.event_attempts == [] and events_dropped() - dropped == 3


@pytest.mark.parametrize("status", [403, 422])
def test_an_event_the_api_server_refuses_for_good_is_let_go_and_holds_up_none_after_it(status):
    kube = FakeKube(event_error=answered(status))
    m = mirror(FakeLedger(), kube)
    queued_events(m, 2)
    assert m.events.round() == m.events.period, "both tried in the one round, nothing left"
    assert kube.event_attempts == ["AttemptStarted"] * 2
    kube.event_error = None
    assert posted(m, kube) == []


def test_events_refused_because_this_replica_stopped_leading_are_dropped_when_it_leads_again():
    # Posted in a later leadership, hours later maybe, they would show out of order beside the other
    # leader's Events.
    kube = FakeKube(event_error=NotLeading("Event AttemptStarted about Task ns/t-u0"))
    m = mirror(FakeLedger(), kube)
    queued_events(m, 2)
    with pytest.raises(NotLeading):
        m.events.round()
    assert kube.event_attempts == ["AttemptStarted"], "the fault fired"
    kube.event_error = None
    dropped = events_dropped()
    m.take_over()
    assert events_dropped() - dropped == 2
    assert posted(m, kube) == []


def test_the_events_of_the_writes_in_flight_when_the_operator_stops_are_posted():
    """Runtime.stop stops every loop at once: the writes in flight end after the poster found
    nothing queued, and their Events would be lost (the next leader finds the statuses current)."""
    kube = FakeKube(task_object("u"))
    entered, release = threading.Event(), threading.Event()
    patch = kube.patch_task_status

    def patch_slowly(namespace, name, uid, status):
        entered.set()
        release.wait(5)
        patch(namespace, name, uid, status)

    kube.patch_task_status = patch_slowly
    m = mirror(FakeLedger(rec("u")), kube)
    loops = [threading.Thread(target=loop.run, daemon=True) for loop in (m, m.events)]
    for loop in loops:
        loop.start()
    m.mark("u")
    assert entered.wait(5), "a write in flight"
    m.stop()
    m.events.stop()
    release.set()
    for loop in loops:
        loop.join(10)
    assert kube.written == [("u", 7, "Running")]
    assert kube.events[:1] == ["Accepted"], kube.events


def test_a_round_of_the_poster_ends_after_its_time_so_slow_posts_keep_the_loop_judged_alive(monkeypatch):
    # The probes judge a loop by its rounds (retex.operator.health): one round draining 1,000
    # Events at 230 ms each would run for minutes.
    monkeypatch.setattr("retex.operator.events.EVENT_ROUND_SECONDS", 0.2)
    kube = FakeKube()
    post = kube.post_event

    def post_slowly(task, *, reason, message, warning):
        time.sleep(0.1)
        post(task, reason=reason, message=message, warning=warning)

    kube.post_event = post_slowly
    m = mirror(FakeLedger(), kube)
    queued_events(m, 10)
    assert m.events.round() == 0.0, "more queued: the next round at once"
    assert 1 <= len(kube.events) <= 3


def test_a_queue_that_fills_again_after_a_takeover_is_logged_again(monkeypatch, caplog):
    monkeypatch.setattr("retex.operator.events.EVENT_QUEUE_CAPACITY", 1)
    m = mirror(FakeLedger(), FakeKube())
    queued_events(m, 2)
    m.take_over()  # the earlier leadership's queue and its drops forgotten
    queued_events(m, 2)
    full = "event queue full: Events other than a task's end are dropped until it drains"
    assert [r.message for r in caplog.records].count(full) == 2


def test_a_namespace_whose_post_succeeded_backs_off_from_the_first_delay_at_its_next_failure():
    now = [1000.0]
    kube = FakeKube(event_error=answered(503))
    m = StatusMirror(FakeLedger(), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    queued_events(m, 1)
    m.events.round()  # fails: 1 s
    now[0] += 1.5
    m.events.round()  # fails again: 2 s
    kube.event_error = None
    now[0] += 2.5
    assert posted(m, kube) == ["AttemptStarted"]
    kube.event_error = answered(503)
    queued_events(m, 1)
    m.events.round()  # fails: 1 s again, not 4
    now[0] += 1.5
    tried = len(kube.event_attempts)
    m.events.round()
    assert len(kube.event_attempts) == tried + 1, "tried again after the first delay"


def test_while_every_queued_event_waits_for_its_namespace_the_poster_waits_too_and_does_not_spin():
    # A namespace whose backoff has passed but has nothing queued (its Events dropped after their
    # tries) must not make the poster take the wait as over and go round again at once.
    now = [1000.0]
    kube = FakeKube(event_error=answered(503))
    m = StatusMirror(FakeLedger(), kube, NO_LEASES, resync_seconds=3600, clock=lambda: now[0])
    m.events.put(event_in("x", "x0"), "AttemptStarted", "x", False)
    for _ in range(EVENT_POST_TRIES):  # x's Event tried and dropped; x's backoff entry stays
        m.events.round()
        now[0] += 61
    m.events.put(event_in("a", "a0"), "AttemptStarted", "a", False)
    m.events.round()  # a fails: a backs off 1 s
    assert kube.event_attempts.count("AttemptStarted") == EVENT_POST_TRIES + 1, "the faults fired"
    assert m.events.round() > 0, "a's Event waits for a's backoff: the loop pauses, not spins"
