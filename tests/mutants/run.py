"""`make mutants`: does the suite have teeth? Each mutant switches off one mechanism with a one-hunk
patch (tests/mutants/<name>.patch) applied to a throwaway copy of HEAD, then runs the tests that
depend on that mechanism there. A mutant is killed when at least one of them fails; a survivor
is a missing test. The table is printed and written into docs/contributing/testing.md.

    python -m tests.mutants.run [name ...]     # default: every mutant

The copy is a `git worktree` of HEAD under /tmp with its own .venv: the main .venv's packages
(through a .pth), but the copy's operator/ first on sys.path, and console scripts of its own —
the rig's node agents run pods with PATH = <repo>/.venv/bin, so worker pods run the mutant too.
Uncommitted changes are not in the copy: commit first. Every mutant runs on the commit HEAD was
when the run began (patches from that commit too), whatever lands meanwhile. Exit status: 0 if every mutant was killed,
1 otherwise (a survivor, a patch that no longer applies, or a run that errored).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATCHES = Path(__file__).resolve().parent
TESTING_DOC = REPO / "docs" / "contributing" / "testing.md"
BEGIN, END = "<!-- mutants:begin -->", "<!-- mutants:end -->"
MATRIX = "tests/cluster/test_crash_matrix.py"


@dataclass(frozen=True)
class Mutant:
    name: str  # its patch is tests/mutants/<name>.patch
    mechanism: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("epoch-fence", "the epoch fence on every worker write",
           (f"{MATRIX}::test_R11_a_zombie_frozen_after_its_effect_is_fenced_when_it_resumes_after_the_next_epoch_committed",)),
    Mutant("deterministic-job-name", "the outbox's deterministic Job name",
           (f"{MATRIX}::test_R1_R2_R3_operator_killed_around_admission_and_dispatch_converges_to_one_task_and_one_job[R3-after-job-create]",)),
    Mutant("lease-reaper", "the lease reaper (expired lease → next attempt)",
           (f"{MATRIX}::test_R11_a_zombie_frozen_after_its_effect_is_fenced_when_it_resumes_after_the_next_epoch_committed",)),
    Mutant("observed-death", "the reaper's use of a holder's ended pod (pod watch, or a look once late → next attempt before expiry)",
           (f"{MATRIX}::test_R5_worker_killed_holding_the_lease_before_any_step_is_replaced_once_its_pod_is_seen_dead",
            "tests/cluster/test_reaper.py::test_a_worker_killed_mid_step_is_replaced_as_soon_as_its_pod_ended_before_any_renewal_is_late",
            "tests/unit/test_reaper.py::test_a_holder_whose_pod_has_terminated_is_replaced_before_its_lease_expires")),
    Mutant("pod-watch-death", "the pod watch's word that a holder's pod ended (next attempt before any renewal is late)",
           ("tests/cluster/test_reaper.py::test_a_worker_killed_mid_step_is_replaced_as_soon_as_its_pod_ended_before_any_renewal_is_late",
            "tests/unit/test_reaper.py::test_a_holder_whose_pod_the_watch_saw_end_is_replaced_before_any_renewal_is_late")),
    Mutant("pod-watch-wake", "the pod watch waking the reaper when a worker pod ends (judged now, not at the next round)",
           ("tests/unit/test_reaper.py::test_a_holder_pod_the_watch_sees_end_wakes_the_reaper_for_a_round_now",)),
    Mutant("verify-before-rerun", "verify before re-running an interrupted step",
           (f"{MATRIX}::test_R6_worker_killed_before_its_commit_landed_the_next_attempt_resolves_the_started_step[R6-verify-after-effect:ship]",)),
    Mutant("disruption-count", "the disruption count (a replaced attempt is a disruption)",
           (f"{MATRIX}::test_R7_worker_killed_after_a_commit_never_runs_the_committed_step_again",)),
    Mutant("concurrency-key", "the concurrency-key check",
           ("tests/integration/test_ledger_policies.py::test_one_task_per_concurrency_key_runs_and_the_next_is_the_oldest_whatever_its_priority",
            "tests/cluster/test_policies.py::test_one_task_per_concurrency_key_runs_at_a_time_in_creation_order_across_a_restart")),
    Mutant("status-monotonic-version", "the status mirror's monotonic ledgerVersion (mirror check and CRD rule)",
           (f"{MATRIX}::test_R4_an_older_status_never_overwrites_a_newer_one",)),
    Mutant("relay-record-isolation", "one refused Job fails its own task only (the relay's per-record outcome)",
           ("tests/cluster/test_relay.py::test_one_task_whose_job_the_api_server_refuses_fails_alone_and_thirty_behind_it_finish",)),
    Mutant("start-deadline", "the start deadline (a worker pod that can never start fails its attempt)",
           ("tests/cluster/test_reaper.py::test_a_worker_pod_that_never_starts_fails_its_attempt_with_the_reason_kubernetes_gives",)),
    Mutant("purge-tombstone", "the tombstone that keeps a purged task from being admitted again",
           ("tests/integration/test_ledger_lifecycle.py::test_a_purged_task_is_never_admitted_again",
            "tests/cluster/test_reaper.py::test_a_task_purged_by_history_retention_is_not_run_again_after_an_operator_restart")),
    Mutant("lease-confirm-get", "the reaper's GET of the Lease before it replaces an attempt",
           ("tests/unit/test_reaper.py::test_a_lease_the_stale_watch_shows_expired_is_not_replaced_when_the_get_shows_a_renewal",
            "tests/cluster/test_reaper.py::test_an_operator_paused_longer_than_a_lease_condemns_no_live_worker")),
    Mutant("spec-mismatch", "the relay's check of the ledger's spec against the live Task",
           ("tests/cluster/test_relay.py::test_a_spec_changed_in_the_ledger_is_never_dispatched_the_task_fails_as_spec_mismatch",)),
    Mutant("leadership-term", "the ledger's leadership-term check on the operator's writes",
           ("tests/integration/test_ledger_leadership.py::test_a_replaced_leaders_writes_are_refused_and_write_nothing",
            "tests/cluster/test_operator_ha.py::test_a_leader_resumed_after_its_successor_started_writes_nothing_its_open_transaction_is_refused",
            "tests/cluster/test_operator_ha.py::test_a_leader_resumed_between_its_leading_check_and_a_ledger_write_is_refused_by_the_term_fence")),
    Mutant("session-limits", "the operator sessions' limits (a frozen replica's locks are freed)",
           ("tests/integration/test_ledger_leadership.py::test_a_predecessor_frozen_in_its_transaction_is_ended_by_the_server_and_its_write_refused",
            "tests/cluster/test_operator_ha.py::test_a_leader_lost_inside_a_ledger_transaction_does_not_block_its_successor_and_every_task_ends_once")),
    Mutant("endpoint-pod-binding", "the ledger endpoint's check that the calling pod is a worker of the task",
           ("tests/cluster/test_tenancy.py::test_a_forged_worker_in_one_namespace_for_a_task_of_another_is_refused",
            "tests/cluster/test_tenancy.py::test_a_pod_with_the_labels_but_no_job_is_refused")),
    Mutant("ledger-witness", "the Task as the ledger's witness (a Task showing more than the ledger holds is frozen)",
           ("tests/cluster/test_ledger_restore.py::test_a_ledger_restored_from_a_backup_freezes_what_it_forgot_and_recovery_repeats_no_effect",
            "tests/cluster/test_status_mirror.py::test_a_ledger_that_forgot_commits_a_tasks_status_showed_freezes_the_task_and_says_so")),
    Mutant("install-identity", "the install that owns the ledger (another install's operator refuses to start)",
           ("tests/integration/test_ledger_witness.py::test_a_ledger_is_owned_by_the_first_install_and_refuses_another_unless_adopted",
            "tests/cluster/test_install_identity.py::test_an_operator_of_another_install_refuses_a_ledger_it_does_not_own")),
)


@dataclass
class Result:
    mutant: Mutant
    verdict: str  # killed | SURVIVED | PATCH DOES NOT APPLY | ERROR (pytest exit N)
    failed: list[str]
    seconds: float


def patch_of(mutant: Mutant, tree: Path = REPO) -> Path:
    return tree / PATCHES.relative_to(REPO) / f"{mutant.name}.patch"


def applies(tree: Path, patch: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(tree), "apply", "--check", str(patch)], capture_output=True, text=True)


def make_copy(tree: Path, commit: str) -> Path:
    """A worktree of `commit` at `tree` with a .venv that runs *its* operator/ (see the module doc)."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), commit], check=True)
    venv = tree / ".venv"
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    main_site = sysconfig.get_path("purelib")
    # Line order is sys.path order: the copy's operator/ before the main site's editable retex.
    (site / "retex_mutant.pth").write_text(f"{tree / 'operator'}\nimport site; site.addsitedir({main_site!r})\n")
    for script in ("retex-operator", "retex-worker", "retex", "kubectl-retex"):
        body = (Path(sys.prefix) / "bin" / script).read_text().split("\n", 1)[1]
        target = venv / "bin" / script
        target.write_text(f"#!{venv / 'bin' / 'python'}\n{body}")
        target.chmod(0o755)
    return tree


def remove_copy(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    shutil.rmtree(tree, ignore_errors=True)


def run_mutant(mutant: Mutant, commit: str) -> Result:
    started = time.monotonic()
    tree = Path(tempfile.mkdtemp(prefix=f"retex-mutant-{mutant.name}-")) / "repo"
    tree.parent.chmod(0o755)  # worker pods and Postgres run as `nobody` and read the copy
    try:
        make_copy(tree, commit)
        check = applies(tree, patch_of(mutant, tree))
        if check.returncode != 0:
            print(f"!!! {mutant.name}: PATCH DOES NOT APPLY to HEAD:\n{check.stderr}", file=sys.stderr)
            return Result(mutant, "PATCH DOES NOT APPLY", [], time.monotonic() - started)
        subprocess.run(["git", "-C", str(tree), "apply", str(patch_of(mutant, tree))], check=True)
        report = tree / "mutant-junit.xml"
        print(f"==> {mutant.name}: {mutant.mechanism} switched off; running {len(mutant.tests)} test(s)", flush=True)
        done = subprocess.run([str(tree / ".venv" / "bin" / "python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *mutant.tests], cwd=tree)
        failed = _failed(report)
        if done.returncode == 0:
            verdict = "SURVIVED"
        elif done.returncode == 1 and failed:
            verdict = "killed"
        else:  # collection errors, a crash of pytest: not a kill
            verdict = f"ERROR (pytest exit {done.returncode})"
        return Result(mutant, verdict, failed, time.monotonic() - started)
    finally:
        remove_copy(tree)
        shutil.rmtree(tree.parent, ignore_errors=True)


def _failed(report: Path) -> list[str]:
    if not report.exists():
        return []
    return [case.get("name") for case in ET.parse(report).iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def table(results: list[Result]) -> str:
    rows = ["| mutant | mechanism switched off | tests run | verdict | failed |", "|---|---|---|---|---|"]
    for r in results:
        tests = "<br>".join(f"`{t.split('::')[-1]}`" for t in r.mutant.tests)
        rows.append(f"| `{r.mutant.name}` | {r.mutant.mechanism} | {tests} | **{r.verdict}** ({r.seconds:.0f} s) | "
                    f"{'<br>'.join(f'`{f}`' for f in r.failed) or '-'} |")
    return "\n".join(rows)


def write_doc(results: list[Result], commit: str, began: str) -> None:
    text = TESTING_DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    ended = time.strftime("%H:%M UTC", time.gmtime())
    TESTING_DOC.write_text(f"{head}{BEGIN}\nLast `make mutants`: {began}–{ended}, every mutant on {commit}.\n\n"
                           f"{table(results)}\n{END}{tail}")


def main(names: list[str]) -> int:
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown mutant(s) {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    # One commit for every mutant, whatever lands on the branch meanwhile.
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    began = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    results = [run_mutant(known[n], commit) for n in names or known]
    print(table(results))
    if not names:  # only a full run speaks for the suite in docs/contributing/testing.md
        write_doc(results, commit, began)
    return 0 if all(r.verdict == "killed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
