"""Loading credentials: a kubeconfig when KUBECONFIG names one (the local rig hands each pod its
own, made from a TokenRequest), otherwise the in-cluster service account.

Every call is one attempt (`retries = False`): urllib3's default three retries, each with a fresh
timeout, would stretch a call to a silent API server to 4× its request timeout, and could send a
write long after the operator's may_write check before it (the D−R bound, retex.kube.operator_calls).
The caller's loop retries on its own schedule."""

from __future__ import annotations

import os

from kubernetes import client, config


def api_client() -> client.ApiClient:
    configuration = client.Configuration()
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.retries = False
    return client.ApiClient(configuration)
