"""The worker's API client: JSON calls on urllib3, without the `kubernetes` package (whose import,
~150 ms of requests, oauthlib and google-auth, every worker pod paid for its two Lease calls).

- Credentials as the operator's client loads them (retex.kube.client): the kubeconfig KUBECONFIG
  names (the local rig hands each pod its own, made from a TokenRequest; tests run workers with
  the rig's admin one), else the in-cluster service account. A token read from a file (the
  projected service-account token, which the kubelet rotates, or a kubeconfig's tokenFile) is read
  again once it is a minute old, as the kubernetes client does.
- One attempt per call, bounded by the call's timeout (retex.kube.client says why: no retries).
- A non-2xx answer raises retex.kube.errors.ApiError (what the error predicates read); a transport
  failure raises urllib3's or the OS's error as it is (`transient` to both).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3

from retex.kube.errors import ApiError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_SECONDS = 60.0


class CredentialsError(Exception):
    """No usable credentials: no KUBECONFIG and not in a pod, or a kubeconfig this client cannot use."""


def kubeconfig_path() -> str | None:
    """The kubeconfig to use, if any: with none, a process uses its pod's service account. The
    one place that makes this choice, for the operator's client and the worker's."""
    return os.environ.get("KUBECONFIG") or None


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to prove who we are, as PEM text and a token."""

    server: str
    ca_pem: str | None = None  # None: the system's CAs
    insecure: bool = False  # a kubeconfig's insecure-skip-tls-verify
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None  # read again when a minute old (token, if set, wins)
    client_cert_pem: str | None = None
    client_key_pem: str | None = field(default=None, repr=False)  # secrets: never in a repr or a log

    @classmethod
    def from_environment(cls) -> Credentials:
        path = kubeconfig_path()
        return cls.from_kubeconfig(path) if path else cls.in_cluster()

    @classmethod
    def in_cluster(cls, directory: Path = SERVICE_ACCOUNT_DIR) -> Credentials:
        """The pod's service account, as client-go's rest.InClusterConfig finds it."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise CredentialsError("neither KUBECONFIG nor KUBERNETES_SERVICE_HOST/PORT is set: not in a pod")
        host = f"[{host}]" if ":" in host else host
        token_file = directory / "token"
        if not token_file.is_file():
            raise CredentialsError(f"no service account token at {token_file}")
        return cls(server=f"https://{host}:{port}", ca_pem=(directory / "ca.crt").read_text(), token_file=token_file)

    @classmethod
    def from_kubeconfig(cls, path: str) -> Credentials:
        """The current context's cluster and user. KUBECONFIG may list files (`:`-separated): the
        first that names an entry wins, as kubectl merges them. Exec plugins, auth providers and
        passwords are refused: a worker pod's kubeconfig has a token or a client certificate."""
        # Imported here: a worker in a pod (no KUBECONFIG) never loads yaml.
        import yaml

        merged: dict[str, Any] = {"clusters": {}, "users": {}, "contexts": {}, "current-context": None}
        bases: dict[tuple[str, str], Path] = {}  # relative file names are relative to their kubeconfig
        for name in filter(None, path.split(os.pathsep)):
            file = Path(name)
            if not file.exists():
                continue
            config = yaml.safe_load(file.read_text()) or {}
            merged["current-context"] = merged["current-context"] or config.get("current-context")
            for kind, key in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
                for entry in config.get(kind) or []:
                    if entry.get("name") not in merged[kind]:
                        merged[kind][entry["name"]] = entry.get(key) or {}
                        bases[(kind, entry["name"])] = file.parent
        context = merged["contexts"].get(merged["current-context"])
        if context is None:
            raise CredentialsError(f"kubeconfig {path}: no current context {merged['current-context']!r}")
        cluster, user = merged["clusters"].get(context.get("cluster")), merged["users"].get(context.get("user"), {})
        if cluster is None or not cluster.get("server"):
            raise CredentialsError(f"kubeconfig {path}: no server for cluster {context.get('cluster')!r}")
        unsupported = {"exec", "auth-provider", "username", "password"} & set(user)
        if unsupported:
            raise CredentialsError(f"kubeconfig {path}: the worker's client does not support {sorted(unsupported)}")
        cluster_base, user_base = bases[("clusters", context["cluster"])], bases.get(("users", context.get("user")), Path())
        token_file = user.get("tokenFile")
        return cls(
            server=cluster["server"],
            ca_pem=_data_or_file(cluster, "certificate-authority", cluster_base),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            token=user.get("token") or None,
            token_file=user_base / token_file if token_file else None,
            client_cert_pem=_data_or_file(user, "client-certificate", user_base),
            client_key_pem=_data_or_file(user, "client-key", user_base),
        )


def _data_or_file(entry: dict[str, Any], key: str, base: Path) -> str | None:
    """`<key>-data` (base64 PEM) or `<key>` (a file name) of a kubeconfig entry, as PEM text."""
    if entry.get(f"{key}-data"):
        return base64.b64decode(entry[f"{key}-data"]).decode()
    if entry.get(key):
        return (base / str(entry[key])).read_text()
    return None


class RestClient:
    """JSON calls to the API server, one attempt each. Thread-safe (the renewer and the main thread)."""

    def __init__(self, credentials: Credentials):
        self._credentials = credentials
        self._server = credentials.server.rstrip("/")
        self._token_lock = threading.Lock()
        self._token: str | None = credentials.token
        self._token_read_at = float("-inf")
        self._http = urllib3.PoolManager(maxsize=2, retries=False, ssl_context=_ssl_context(credentials))

    @classmethod
    def from_environment(cls) -> RestClient:
        return cls(Credentials.from_environment())

    def close(self) -> None:
        self._http.clear()

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout: float) -> dict[str, Any]:
        """`method` on `path` (from /api or /apis), `body` sent as JSON; the answer as a dict.
        Raises ApiError for a non-2xx answer, urllib3's errors when none came within `timeout`."""
        headers = {"Accept": "application/json", "User-Agent": "retex-worker"}
        token = self._bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:
            headers["Content-Type"] = "application/json"
        response = self._http.request(method, self._server + path, headers=headers,
                                      body=json.dumps(body).encode() if body is not None else None,
                                      timeout=urllib3.Timeout(total=timeout), retries=False)
        if not 200 <= response.status < 300:
            raise ApiError(response.status, response.reason or "", response.data.decode(errors="replace"))
        answer: dict[str, Any] = json.loads(response.data)
        return answer

    def _bearer_token(self) -> str | None:
        token_file = self._credentials.token_file
        if self._credentials.token or token_file is None:
            return self._token
        with self._token_lock:
            if time.monotonic() - self._token_read_at >= TOKEN_REREAD_SECONDS:
                self._token = token_file.read_text().strip()
                self._token_read_at = time.monotonic()
            return self._token


def _ssl_context(credentials: Credentials) -> ssl.SSLContext:
    """The server checked against the CA (host name included) unless the kubeconfig says not to;
    the client certificate, if any, loaded once (ssl only loads one from a file: a private
    temporary one, gone before this returns)."""
    context = ssl.create_default_context(cadata=credentials.ca_pem)
    if credentials.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if credentials.client_cert_pem and credentials.client_key_pem:
        with tempfile.TemporaryDirectory(prefix="retex-kube-") as directory:
            chain = Path(directory) / "client.pem"
            chain.touch(mode=0o600)
            chain.write_text(credentials.client_cert_pem.rstrip("\n") + "\n" + credentials.client_key_pem)
            context.load_cert_chain(chain)
    return context
