"""`promtool test rules` runs tests/prometheus/alerts.test.yaml against the shipped rules file: each
alert is tested firing and not firing. Needs Debian's `prometheus` package (.ci/run installs it);
without promtool these fail rather than skip, so CI cannot pass without having run them."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.test_alert_rules import RULES_FILE, rules

pytestmark = pytest.mark.prometheus

ALERT_TESTS = Path(__file__).with_name("alerts.test.yaml")


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: apt-get install prometheus (as .ci/run does)"
    return path


def test_promtool_accepts_the_rules_file():
    checked = subprocess.run([promtool(), "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    firing, quiet = set(), set()
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    alerts = {rule["alert"] for group in rules()["groups"] for rule in group["rules"]}
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested staying quiet"


def test_promtool_unit_tests_of_the_alerts_pass():
    run = subprocess.run([promtool(), "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
