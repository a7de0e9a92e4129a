"""Python steps are called as `function(context, **args)` in a child interpreter of the worker.

Return a JSON-able value to succeed; raise retex.worker.PermanentError to fail the task at once;
any other exception is retried. `context.idempotency_key` is stable across attempts: pass it to
the service you call so that a retry after a lost answer does not send twice.
"""

from retex.worker import PermanentError

TEMPLATES = {"xmas-reminder": "Your order ships before the 24th."}


def send_reminder(context, channel: str) -> dict:
    template = context.payload.get("template")
    if template not in TEMPLATES:
        raise PermanentError(f"unknown template {template!r}")
    # A real step calls the mail service here, with context.idempotency_key as its dedup key.
    return {"channel": channel, "to": context.payload["customer"], "text": TEMPLATES[template],
            "dedupKey": context.idempotency_key}


def reminder_sent(context, channel: str) -> dict | None:
    """Verify hook: ask the mail service whether this key was sent (None = not found)."""
    return None
