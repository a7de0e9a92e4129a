"""`retex`: the human's door to the ledger (history, requeue, resolve, dead letters).

Talks to the ledger only, never to the API server, and imports neither kopf nor kubernetes.
Also installed as `kubectl-retex`, so `kubectl retex ...` works as a kubectl plugin.
"""
