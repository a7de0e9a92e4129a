"""pytest fixtures for the local rig (filled in by the local control plane work)."""
