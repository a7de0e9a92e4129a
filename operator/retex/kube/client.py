"""The operator's API client, the official `kubernetes` one. Credentials: a
kubeconfig when KUBECONFIG names one (the local rig hands each pod its own, made from a
TokenRequest), otherwise the in-cluster service account (retex.kube.rest.kubeconfig_path makes the
choice; the worker's lighter client, retex.kube.rest, loads the same credentials itself).

Every call is one attempt (`retries = False`): urllib3's default three retries, each with a fresh
timeout, would stretch a call to a silent API server to 4× its request timeout, and could send a
write long after the operator's may_write check before it (the D−R bound, retex.kube.operator_calls).
The caller's loop retries on its own schedule."""

from __future__ import annotations

from kubernetes import client, config

from retex.kube.rest import kubeconfig_path


def api_client() -> client.ApiClient:
    configuration = client.Configuration()
    path = kubeconfig_path()
    if path:
        config.load_kube_config(config_file=path, client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.retries = False
    # One client for every thread of the operator: two watches, the relay, the reaper, the election,
    # the status mirror's writers (4), kopf's handlers and the ledger endpoint's token reviews. The
    # default, 5 a CPU, is 10 on a 2-CPU node: past it, urllib3 opens a connection per call and
    # drops it after (a TLS handshake each time, and a "pool is full" warning).
    configuration.connection_pool_maxsize = 20
    return client.ApiClient(configuration)
