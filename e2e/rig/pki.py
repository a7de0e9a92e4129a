"""Certificates and kubeconfigs for the local rig, made with the `openssl` command line tool.

One CA signs everything: the API server's serving certificate and the client certificates of the
admin user (group system:masters), the controller manager and the scheduler (the users the
bootstrap RBAC policy already knows). A separate key pair signs and verifies service-account
tokens. EC P-256 keys: generated in milliseconds, accepted by every component.
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
import subprocess
from pathlib import Path

import yaml

DAYS = "3650"
SERVER_SANS = (
    "IP:127.0.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of the generated material (all under one directory)."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


# Client identities: file name -> (CN, O). The CNs are the users bootstrap RBAC binds to roles.
CLIENTS = {
    "admin": ("retex-rig-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
}


def _openssl(*args: str, input: str | None = None) -> None:
    subprocess.run(["openssl", *args], input=input, text=True, check=True, capture_output=True)


def _genkey(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)


def _sign(pki: Pki, name: str, subject: str, extensions: str) -> None:
    ext_file = pki.dir / f"{name}.ext"
    ext_file.write_text(extensions)
    csr = subprocess.run(
        ["openssl", "req", "-new", "-key", str(pki.key(name)), "-subj", subject],
        check=True, capture_output=True, text=True,
    ).stdout
    _openssl(
        "x509", "-req", "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
        "-set_serial", f"0x{secrets.token_hex(16)}", "-days", DAYS,
        "-extfile", str(ext_file), "-out", str(pki.crt(name)),
        input=csr,
    )
    ext_file.unlink()


def create(directory: Path) -> Pki:
    """Generate the whole PKI into `directory` (created if missing, existing files replaced)."""
    pki = _new_ca(directory, "retex-rig-ca")
    pki.ca_crt.chmod(0o644)  # pods running as non-root users read it through their kubeconfig
    _serving(pki, "apiserver", "kube-apiserver", SERVER_SANS)
    for name, (cn, org) in CLIENTS.items():
        _genkey(pki.key(name))
        subject = (f"/O={org}" if org else "") + f"/CN={cn}"
        _sign(
            pki, name, subject,
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=clientAuth\n",
        )

    _genkey(pki.sa_key)
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub))
    return pki


def ledger_serving(directory: Path, pod_host: str = "127.0.0.1") -> Pki:
    """A CA of its own and the ledger endpoint's serving certificate (`ledger`), for an operator
    run on this host: its workers reach it at `pod_host` (the loopback on the rig, the host's
    address on the kind network) and verify it against that CA."""
    pki = _new_ca(directory, "retex-ledger-ca")
    _serving(pki, "ledger", "retex-ledger", tuple(dict.fromkeys(("IP:127.0.0.1", f"IP:{pod_host}", "DNS:localhost"))))
    return pki


def _new_ca(directory: Path, cn: str) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    _genkey(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(pki.ca_key), "-subj", f"/CN={cn}", "-days", DAYS,
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-out", str(pki.ca_crt),
    )
    return pki


def _serving(pki: Pki, name: str, cn: str, sans: tuple[str, ...]) -> None:
    _genkey(pki.key(name))
    _sign(
        pki, name, f"/CN={cn}",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={','.join(sans)}\n",
    )


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(
    path: Path, server: str, ca_crt: Path, *, user: str,
    client_crt: Path | None = None, client_key: Path | None = None, token: str | None = None,
) -> Path:
    """A self-contained kubeconfig (certificates embedded) for one user, context `retex-rig`."""
    credentials: dict[str, str] = {}
    if client_crt is not None and client_key is not None:
        credentials = {
            "client-certificate-data": _b64(client_crt),
            "client-key-data": _b64(client_key),
        }
    if token is not None:
        credentials["token"] = token
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "retex-rig", "cluster": {
            "server": server, "certificate-authority-data": _b64(ca_crt)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "retex-rig", "context": {"cluster": "retex-rig", "user": user}}],
        "current-context": "retex-rig",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)  # atomic: a reader never sees half a kubeconfig
    return path
