"""Workers run by a test without the operator: the operator's ledger endpoint served from the test
process, and a real pod identity for an attempt.

A worker proves which attempt it runs with its pod's projected token (docs/security.md). A test
that runs `retex-worker` as a plain process (to pause or kill it like a pod) gives it the identity
of a real pod of the attempt's Job: the Job is built as the operator builds it but pinned to a
node that does not exist, so its pod stays Pending, and a TokenRequest bound to that pod, for the
endpoint's audience, is the worker's token.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.postgres import free_port
from e2e.rig import pki as pkilib
from retex.kube.identity import WorkerIdentities
from retex.ledger import Ledger
from retex.ledger.wire import TOKEN_AUDIENCE
from retex.operator.ledger_endpoint import LedgerEndpoint, LedgerTls, serve

NOWHERE = {"retex.dev/test-node": "nowhere"}


class LocalLedgerEndpoint:
    """The endpoint as the operator serves it (TLS with a CA of its own), from the test process."""

    def __init__(self, ledger: Ledger, api: client.ApiClient):
        self.port = free_port()
        self._tls_dir = tempfile.TemporaryDirectory(prefix="retex-ledger-tls-")
        pki = pkilib.ledger_serving(Path(self._tls_dir.name))
        tls = LedgerTls(str(pki.crt("ledger")), str(pki.key("ledger")), str(pki.ca_crt))
        self.ca_pem = tls.ca_pem()  # what a worker is handed to verify it (RETEX_LEDGER_CA)
        self._server = serve(LedgerEndpoint(ledger, WorkerIdentities(api)), self.port, tls)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._tls_dir.cleanup()


def pending_attempt_pod(api: client.ApiClient, job: dict[str, Any]) -> client.V1Pod:
    """Create `job` pinned nowhere and return its pod, which never runs."""
    return pending_attempt_pods(api, job, 1)[0]


def pending_attempt_pods(api: client.ApiClient, job: dict[str, Any], count: int, *,
                         timeout: float = 30) -> list[client.V1Pod]:
    """Create `job` pinned nowhere with `count` pods at once (two pods of one attempt, as a
    repeated dispatch or a lost node can leave), sorted by name; none of them ever runs."""
    namespace = job["metadata"]["namespace"]
    job["spec"]["template"]["spec"]["nodeSelector"] = NOWHERE
    job["spec"]["parallelism"] = job["spec"]["completions"] = count
    client.BatchV1Api(api).create_namespaced_job(namespace, job)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = client.CoreV1Api(api).list_namespaced_pod(
            namespace, label_selector=f"job-name={job['metadata']['name']}").items
        if len(pods) >= count:
            return sorted(pods, key=lambda p: p.metadata.name)[:count]
        time.sleep(0.1)
    raise AssertionError(f"no {count} pods for Job {namespace}/{job['metadata']['name']} within {timeout}s")


def pod_token(api: client.ApiClient, pod: client.V1Pod, path: Path, *, audience: str = TOKEN_AUDIENCE) -> Path:
    """A token bound to `pod`, minted as the kubelet mints a projected one, written to `path`."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
        audiences=[audience], expiration_seconds=3600,
        bound_object_ref=client.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod.metadata.name,
                                                        uid=pod.metadata.uid)))
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        pod.spec.service_account_name, pod.metadata.namespace, request).status.token
    path.write_text(token)
    return path
