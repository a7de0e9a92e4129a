"""The tests' kubectl helper waits as long as a `kubectl wait --timeout=` it runs: its own 60 s
limit killed a 90 s wait on kind (a slower pod start) before kubectl could answer."""

import pytest

from e2e.rig.controlplane import kubectl_timeout_seconds


@pytest.mark.parametrize(("args", "seconds"), [
    (("wait", "--for=condition=Succeeded", "--timeout=90s", "task/t"), 90),
    (("wait", "--timeout=2m", "task/t"), 120),
    (("wait", "--timeout=1m30s", "task/t"), 90),
    (("get", "tasks"), 0),
])
def test_a_kubectl_timeout_argument_is_read_in_seconds(args, seconds):
    assert kubectl_timeout_seconds(args) == seconds
