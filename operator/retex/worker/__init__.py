"""The retex worker: runs one attempt of one task in its Job's pod (console script `retex-worker`).

What step code imports: `PermanentError` and `RetryableError` (how a python step says why it
failed) and `StepContext` (what a python step is called with). Kept free of heavy imports: python
steps run in a child interpreter that imports this package.
"""

from retex.worker.context import PermanentError, RetryableError, StepContext

__all__ = ["PermanentError", "RetryableError", "StepContext"]
