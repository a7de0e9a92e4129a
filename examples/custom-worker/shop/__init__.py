"""Example step code for a custom worker image (examples/custom-worker/Dockerfile)."""
