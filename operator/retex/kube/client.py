"""Loading credentials: a kubeconfig when KUBECONFIG names one (the local rig hands each pod its
own, made from a TokenRequest), otherwise the in-cluster service account."""

from __future__ import annotations

import os

from kubernetes import client, config


def api_client() -> client.ApiClient:
    configuration = client.Configuration()
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)
