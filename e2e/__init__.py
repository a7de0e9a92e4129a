"""Test infrastructure shared by the test suite, `make dev` and the crash-matrix scenarios.

Nothing here ships: it starts throwaway servers (Postgres, the local Kubernetes rig) on loopback.
"""
