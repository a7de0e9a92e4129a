"""The only package that talks to the Kubernetes API server.

Object builders here are pure functions (tested without a cluster); the calls that send them
use the official `kubernetes` client, synchronously: async callers wrap them in a thread.
"""
