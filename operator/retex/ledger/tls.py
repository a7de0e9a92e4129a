"""Who may connect to the ledger insecurely: nobody, unless told so. Pure (the DSN is only parsed).

The ledger holds every tenant's tasks, so a connection must check the server's certificate and
host name (libpq's sslmode=verify-full, from the DSN or else PGSSLMODE), unless
RETEX_DATABASE_INSECURE=1 says otherwise (a dev rig, test fixtures). The operator and the CLI's
DSN mode both ask here. A refusal never echoes the DSN: it may hold a password.
"""

from __future__ import annotations

from collections.abc import Mapping

import psycopg
from psycopg.conninfo import conninfo_to_dict

INSECURE_FLAG = "RETEX_DATABASE_INSECURE"


def unverified_tls_refusal(dsn: str, env: Mapping[str, str]) -> str | None:
    """Why this DSN may not be used (None: it may). `env` supplies PGSSLMODE and the flag."""
    try:
        sslmode = conninfo_to_dict(dsn).get("sslmode") or env.get("PGSSLMODE")
    except psycopg.ProgrammingError:
        return "the ledger DSN does not parse as a Postgres DSN (key=value pairs or a postgresql:// URI)"
    if sslmode == "verify-full" or env.get(INSECURE_FLAG) == "1":
        return None
    return (f"the ledger DSN has sslmode={sslmode or 'unset'}: retex connects to the ledger only with "
            "sslmode=verify-full (TLS, the server's certificate and host name checked; sslrootcert= names "
            f"the CA). Add sslmode=verify-full to the DSN, or set {INSECURE_FLAG}=1 to accept an unverified "
            "connection (development only).")
