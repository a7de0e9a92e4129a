"""A worker's first log line says how long its process has run (`process_age_seconds`): the
start-up cost before it, which the bench's recovery and profile timelines place on the clock."""

import subprocess
import sys


def test_a_process_that_slept_half_a_second_before_asking_reports_at_least_that_age_and_not_much_more():
    code = "import time; time.sleep(0.5); from retex.worker.logs import process_age_seconds; print(process_age_seconds())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30, age


def test_a_process_whose_stat_cannot_be_read_reports_no_age_rather_than_failing_its_start(monkeypatch):
    from retex.worker import logs

    def unreadable(*args, **kwargs):
        raise PermissionError("/proc/self/stat")

    monkeypatch.setattr("builtins.open", unreadable)
    assert logs.process_age_seconds() is None
