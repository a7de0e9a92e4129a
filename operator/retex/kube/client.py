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
    return client.ApiClient(configuration)
