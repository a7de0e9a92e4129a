"""A throwaway PostgreSQL server on a free loopback port, for tests and `make dev`.

Postgres refuses to run as root, so when we are root the server runs as the unprivileged
`nobody` user with its data directory handed over to it. Trust authentication on loopback only:
this server holds test data and dies with the session.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e2e.ports import free_port

SUPERUSER = "retex_admin"


def _bindir() -> Path:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(candidate, "postgres")):
            return Path(candidate)
    found = shutil.which("postgres")
    if found:
        return Path(found).parent
    raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")


def _as_unprivileged() -> list[str]:
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if os.geteuid() == 0 else []


class PostgresServer:
    """One Postgres cluster: `start()`, `stop()`, `restart()`, `kill()`; `dsn()` to connect."""

    def __init__(self, state_dir: Path | None = None, port: int | None = None):
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="retex-pg-"))
        self.data_dir = self.state_dir / "data"
        self.port = port or free_port()
        self.bindir = _bindir()
        self.proc: subprocess.Popen | None = None

    def dsn(self, user: str = SUPERUSER, dbname: str = "postgres", password: str | None = None) -> str:
        auth = f" password={password}" if password else ""
        return f"host=127.0.0.1 port={self.port} user={user} dbname={dbname}{auth} connect_timeout=5"

    def _chown(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.state_dir, "nobody", "nogroup")
            for root, dirs, files in os.walk(self.state_dir):
                for name in dirs + files:
                    shutil.chown(os.path.join(root, name), "nobody", "nogroup")

    def init(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._chown()
        subprocess.run(
            _as_unprivileged()
            + [str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER,
               "--auth=trust", "--encoding=UTF8", "--no-instructions"],
            check=True, stdout=subprocess.DEVNULL,
        )

    def start(self, timeout: float = 30.0) -> None:
        self.init()
        log = open(self.state_dir / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            _as_unprivileged()
            + [str(self.bindir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
               "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.state_dir}",
               "-c", "max_connections=200", "-c", "fsync=on", "-c", "synchronous_commit=on"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.state_dir / "postgres.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"postgres exited on start:\n{tail}")
            ready = subprocess.run(
                [str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise TimeoutError(f"postgres not ready on port {self.port} after {timeout}s")

    def stop(self, mode: signal.Signals = signal.SIGINT) -> None:
        """SIGINT is Postgres' fast shutdown: clients are disconnected, committed data is kept."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(mode)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Crash the whole server (postmaster and backends) as a power loss would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            # Backends die a moment after the postmaster; a new postmaster refuses to start
            # while any of them still holds the old shared memory. Signal the group again until
            # it is empty: a backend forked while the first signal went out escaped it (seen once:
            # "pre-existing shared memory block ... is still in use").
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.state_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="run a throwaway Postgres in the foreground")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    server = PostgresServer(args.state_dir, args.port)
    server.start()
    print(server.dsn(), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
