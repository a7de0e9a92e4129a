"""The QuotaExceeded refusal's message (pure): it names the namespace, what it keeps against
which limit and setting, and what frees room."""

from retex.ledger import QuotaUse
from retex.operator.admission import quota_message


def test_the_message_names_the_namespace_its_use_its_limit_and_what_frees_room():
    message = quota_message(QuotaUse(namespace="shop", resource="tasks", used=100000, limit=100000), retention_days=7)
    assert message.startswith("namespace shop keeps 100000 tasks in the ledger, at or over its limit of 100000 "
                              "(the operator's RETEX_NAMESPACE_MAX_TASKS)")
    assert "leaves the ledger 7 days after it ended (history retention), whether or not its Task was deleted" in message
    assert "ask the operator's administrator" in message and "create it again once there is room" in message


def test_a_namespace_over_its_result_bytes_is_told_so_and_retention_off_is_said():
    message = quota_message(QuotaUse(namespace="shop", resource="resultBytes", used=2**30 + 5, limit=2**30),
                            retention_days=None)
    assert f"keeps {2**30 + 5} bytes of step results in the ledger, at or over its limit of {2**30}" in message
    assert "RETEX_NAMESPACE_MAX_RESULT_BYTES" in message and "history retention is off" in message
