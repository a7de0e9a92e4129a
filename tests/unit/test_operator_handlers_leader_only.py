"""Every kopf handler of a Task waits for this replica to lead before it writes (`leader_only`):
between losing the lease and kopf stopping, a handler on the old leader must not act."""

import kopf

import retex.operator.handlers as handlers  # noqa: F401 (registers the handlers with kopf)


def test_every_task_handler_is_leader_only():
    registry = kopf.get_default_registry()
    task_handlers = [*registry._changing.get_all_handlers(), *registry._watching.get_all_handlers(),
                     *registry._spawning.get_all_handlers()]
    assert task_handlers, "no Task handlers registered"
    not_gated = sorted(str(h.id) for h in task_handlers if h.fn.__code__.co_name != "when_leading")
    assert not not_gated, f"handlers that act without leading: {not_gated}"
