"""A Patroni cluster of two PostgreSQL members on loopback: a primary and a synchronous standby.

Its distributed configuration store is the local rig's own etcd (Patroni's `etcd3` DCS), under a
key prefix of its own. Patroni's other choice, the Kubernetes DCS, keeps each member's state in
the annotations of the member's own Pod, so its members must be pods; here they are host
processes, like the throwaway Postgres of e2e/postgres.py, so etcd it is (on kind, where the
members are a StatefulSet's pods, the Kubernetes DCS fits).

Patroni runs Postgres itself, and Postgres refuses to run as root, so when we are root Patroni
runs as `nobody` (e2e.postgres's way) with its state directory handed over to it. Trust
authentication on loopback only: this cluster holds test data and dies with the session.

    cluster = PatroniCluster(etcd="127.0.0.1:2379")
    cluster.start()              # both members up, the standby synchronous
    cluster.dsn(dbname="x")      # both members, target_session_attrs=read-write: libpq picks the primary
    cluster.switchover()         # patronictl switchover to the standby; returns the new leader
    cluster.kill_primary()       # kill -9 of the primary's postmaster; Patroni fails over at once
    cluster.stop()

    PatroniCluster(etcd=..., synchronous=False, maximum_lag_on_failover=2**40)
    cluster.cut_replication()    # the standby receives no more WAL: it lags from now on
    cluster.kill_patroni("pg0")  # that member's Patroni dies (its Postgres runs on, leaderless)
    cluster.expire_leader_key()  # the leader key gone from the DCS, as when its ttl runs out
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import yaml

from e2e.ports import free_port
from e2e.postgres import SUPERUSER, _as_unprivileged, _bindir

SCOPE = "retex-ledger"
REPLICATION_USER = "replicator"

# Settings Patroni writes into its DCS at bootstrap; docs/install.md quotes them as the worked
# example of "What the ledger needs in production".
DCS_SETTINGS: dict[str, Any] = {
    # A leader that stops renewing its key for ttl seconds loses it; each member's loop runs every
    # loop_wait. Short, so a test's failover takes seconds (Patroni's defaults: 30, 10, 10).
    "ttl": 20,
    "loop_wait": 1,
    "retry_timeout": 5,
    # A commit is acknowledged once the synchronous standby has it on disk, and Patroni promotes
    # only that standby: a failover loses no acknowledged commit.
    "synchronous_mode": True,
    # A crashed primary is failed over at once rather than restarted in place (default 300 s).
    "primary_start_timeout": 0,
    "maximum_lag_on_failover": 1048576,
    "postgresql": {
        # The old primary rejoins as a standby even when it had WAL the new one never received.
        "use_pg_rewind": True,
        "parameters": {
            "synchronous_commit": "on",
            "wal_log_hints": "on",
            "max_connections": 200,
            "max_wal_senders": 10,
            "max_replication_slots": 10,
            "hot_standby": "on",
        },
    },
}


def say(message: str) -> None:
    """Progress for humans, as the rig prints its own."""
    print(f"[patroni] {message}", file=sys.stderr, flush=True)


class PatroniError(RuntimeError):
    pass


@dataclass(frozen=True)
class Member:
    name: str
    pg_port: int
    api_port: int
    state_dir: Path

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def config_file(self) -> Path:
        return self.state_dir / "patroni.yml"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "patroni.log"

    def dsn(self, dbname: str = "postgres") -> str:
        """This member alone, whatever its role."""
        return f"host=127.0.0.1 port={self.pg_port} user={SUPERUSER} dbname={dbname} connect_timeout=5"

    def in_recovery(self) -> bool:
        """pg_is_in_recovery(): True on a standby."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        assert row is not None
        return bool(row[0])

    def postmaster_pid(self) -> int | None:
        """The pid in postmaster.pid: the running postmaster's, or a dead one's that left it behind
        (a clean shutdown removes the file)."""
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (FileNotFoundError, ValueError):
            return None


@dataclass(frozen=True)
class Kill:
    """What `kill_primary` did and saw."""

    member: str
    pid: int
    pid_file_left: bool  # postmaster.pid still named the pid after it died: no clean shutdown


class PatroniCluster:
    """Two Patroni members on the DCS at `etcd` (host:port of an etcd v3 endpoint)."""

    def __init__(self, etcd: str, state_dir: Path | None = None, members: int = 2, *, synchronous: bool = True,
                 maximum_lag_on_failover: int | None = None):
        # Under /tmp, not pytest's tree: `nobody` cannot traverse pytest's root-only directories.
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="retex-patroni-"))
        self.etcd = etcd
        # A key prefix of its own: a rig's etcd may hold an earlier run's cluster.
        self.namespace = f"/{self.state_dir.name}/"
        self.members = [Member(f"pg{i}", free_port(), free_port(), self.state_dir / f"pg{i}") for i in range(members)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # Asynchronous: a commit is acknowledged before any standby has it, and a standby lagging by
        # up to maximum_lag_on_failover bytes may be promoted, losing what it had not received.
        self.synchronous = synchronous
        self.dcs_settings = {**DCS_SETTINGS, "synchronous_mode": synchronous}
        if maximum_lag_on_failover is not None:
            self.dcs_settings["maximum_lag_on_failover"] = maximum_lag_on_failover

    # ----- connecting --------------------------------------------------------------------------

    def dsn(self, dbname: str = "postgres") -> str:
        """Every member, in one DSN; libpq tries them in turn and keeps the one that takes writes."""
        hosts = ",".join("127.0.0.1" for _ in self.members)
        ports = ",".join(str(m.pg_port) for m in self.members)
        return (f"host={hosts} port={ports} user={SUPERUSER} dbname={dbname} "
                "target_session_attrs=read-write connect_timeout=5")

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    # ----- configuration -----------------------------------------------------------------------

    def _config(self, member: Member) -> dict[str, Any]:
        return {
            "scope": SCOPE,
            "namespace": self.namespace,
            "name": member.name,
            "restapi": {"listen": f"127.0.0.1:{member.api_port}", "connect_address": f"127.0.0.1:{member.api_port}"},
            "etcd3": {"hosts": [self.etcd]},
            "bootstrap": {
                "dcs": self.dcs_settings,
                "initdb": [{"encoding": "UTF8"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{member.pg_port}",
                "connect_address": f"127.0.0.1:{member.pg_port}",
                "data_dir": str(member.data_dir),
                "bin_dir": str(_bindir()),
                "pgpass": str(member.state_dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER},
                    "replication": {"username": REPLICATION_USER},
                    "rewind": {"username": SUPERUSER},
                },
                "parameters": {"unix_socket_directories": str(member.state_dir)},
                "pg_hba": ["local all all trust",
                           "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
        }

    def _hand_over(self) -> None:
        if os.geteuid() == 0:
            for root, _, files in os.walk(self.state_dir):
                shutil.chown(root, "nobody", "nogroup")
                for name in files:
                    shutil.chown(os.path.join(root, name), "nobody", "nogroup")

    # ----- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> None:
        """Start both members (the first bootstraps, the other clones it) and wait until one
        leads and the other is its synchronous standby, streaming."""
        started = time.monotonic()
        say(f"state directory {self.state_dir}; DCS etcd {self.etcd} under {self.namespace}")
        for member in self.members:
            member.state_dir.mkdir(parents=True, exist_ok=True)
            member.config_file.write_text(yaml.safe_dump(self._config(member)))
        self._hand_over()
        for member in self.members:
            say(f"starting {member.name} (postgres 127.0.0.1:{member.pg_port}, REST 127.0.0.1:{member.api_port})")
            self._spawn(member)
            if member is self.members[0]:
                self._wait("the first member to bootstrap and lead", lambda: self.leader() == self.members[0].name,
                           timeout)
        self.wait_healthy(timeout)
        say(f"cluster up in {time.monotonic() - started:.1f}s: leader {self.leader()}, "
            f"synchronous standby {self.sync_standby()}")

    def _spawn(self, member: Member) -> None:
        log = open(member.log_file, "ab")
        self.procs[member.name] = subprocess.Popen(
            _as_unprivileged() + ["patroni", str(member.config_file)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=member.state_dir,
        )

    def stop(self) -> None:
        """SIGTERM every Patroni (it stops its Postgres first); SIGKILL to the group if it lingers."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for member in self.members:  # a postmaster Patroni left behind (killed before its stop)
            pid = member.postmaster_pid()
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.procs.clear()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    # ----- state -------------------------------------------------------------------------------

    def roles(self) -> dict[str, tuple[str, str]]:
        """{member: (role, state)} as Patroni's REST API reports the cluster ({} if none answers):
        role leader / sync_standby / replica, state running / streaming / stopped / …"""
        for member in self.members:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{member.api_port}/cluster", timeout=3) as answer:
                    cluster = json.load(answer)
            except (OSError, ValueError):
                continue
            return {m["name"]: (m["role"], m.get("state", "")) for m in cluster.get("members", [])}
        return {}

    def leader(self) -> str | None:
        return next((name for name, (role, _) in self.roles().items() if role == "leader"), None)

    def sync_standby(self) -> str | None:
        return next((name for name, (role, _) in self.roles().items() if role == "sync_standby"), None)

    def standby(self) -> str | None:
        """A member that is not the leader (asynchronous: Patroni's role `replica`)."""
        return next((name for name, (role, _) in self.roles().items() if role != "leader"), None)

    def healthy(self) -> bool:
        """A leader running and a standby (synchronous, unless the cluster is not) streaming from it."""
        roles = self.roles()
        standby_role = "sync_standby" if self.synchronous else "replica"
        return (any(r == ("leader", "running") for r in roles.values())
                and any(role == standby_role and state in ("streaming", "running") for role, state in roles.values()))

    def wait_healthy(self, timeout: float = 120) -> None:
        self._wait("a leader and a streaming standby", self.healthy, timeout)

    def _wait(self, what: str, check: Any, timeout: float) -> None:
        started = last_report = time.monotonic()
        while not check():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise PatroniError(f"patroni {name} exited ({proc.returncode}) while waiting for {what}:\n"
                                       + self.member(name).log_file.read_text(errors="replace")[-3000:])
            if time.monotonic() - started > timeout:
                raise PatroniError(f"timed out after {timeout:.0f}s waiting for {what}; roles {self.roles()}")
            if time.monotonic() - last_report >= 3:
                say(f"waiting for {what} ({time.monotonic() - started:.0f}s): roles {self.roles()}")
                last_report = time.monotonic()
            time.sleep(0.2)

    # ----- faults ------------------------------------------------------------------------------

    def switchover(self, timeout: float = 60) -> str:
        """`patronictl switchover` from the leader to the synchronous standby; returns the new leader
        once it leads."""
        leader, candidate = self.leader(), self.sync_standby()
        if not leader or not candidate:
            raise PatroniError(f"no switchover possible: roles {self.roles()}")
        say(f"switchover {leader} -> {candidate}")
        done = subprocess.run(
            ["patronictl", "-c", str(self.member(leader).config_file), "switchover", SCOPE,
             "--leader", leader, "--candidate", candidate, "--force"],
            capture_output=True, text=True, timeout=timeout,
        )
        if done.returncode != 0:
            raise PatroniError(f"patronictl switchover failed ({done.returncode}): {done.stdout}{done.stderr}")
        self._wait(f"{candidate} leading", lambda: self.leader() == candidate, timeout)
        return candidate

    def kill_primary(self, timeout: float = 10) -> Kill:
        """kill -9 of the leader's postmaster (its backends die with it; Patroni lives on and,
        with primary_start_timeout 0, hands the leadership to the synchronous standby)."""
        leader = self.leader()
        if not leader:
            raise PatroniError(f"no leader to kill: roles {self.roles()}")
        member = self.member(leader)
        pid = member.postmaster_pid()
        if pid is None or not _alive(pid):
            raise PatroniError(f"{leader}'s postmaster is not running (postmaster.pid: {pid})")
        say(f"kill -9 {leader}'s postmaster (pid {pid})")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                raise PatroniError(f"postmaster {pid} still alive {timeout:.0f}s after SIGKILL")
            time.sleep(0.01)
        return Kill(leader, pid, pid_file_left=member.postmaster_pid() == pid)

    def cut_replication(self, timeout: float = 30) -> str:
        """The leader refuses replication connections from now on (a `reject` line first in its
        pg_hba.conf, reloaded) and its WAL senders are ended: the standby keeps what it received
        and receives nothing more. Returns the standby's last received LSN once no sender is left."""
        leader = self.leader()
        if not leader:
            raise PatroniError(f"no leader to cut off: roles {self.roles()}")
        member = self.member(leader)
        hba = member.data_dir / "pg_hba.conf"
        hba.write_text("host replication all 127.0.0.1/32 reject\n" + hba.read_text())
        say(f"replication from {leader} cut: its pg_hba.conf rejects it, its WAL senders ended")
        with psycopg.connect(member.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + timeout
            while conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_replication").fetchall():
                if time.monotonic() > deadline:
                    raise PatroniError(f"{leader} still has WAL senders {timeout:.0f}s after the cut")
                time.sleep(0.2)
        standby = self.member(next(m.name for m in self.members if m.name != leader))
        with psycopg.connect(standby.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT pg_last_wal_receive_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])

    def kill_patroni(self, name: str, timeout: float = 10) -> int:
        """kill -9 of one member's Patroni alone: its Postgres runs on, but nothing renews its
        leader key (another member takes it once ttl runs out) or restarts that Postgres.
        Returns the Patroni's pid."""
        proc = self.procs[name]
        say(f"kill -9 {name}'s Patroni (pid {proc.pid})")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
        return proc.pid

    def expire_leader_key(self) -> None:
        """The leader key deleted from the DCS, as its ttl (at least 20 s) running out would: the
        other members race for it at once. For a leader whose Patroni is dead (`kill_patroni`),
        that would renew it no more."""
        key = f"{self.namespace.rstrip('/')}/{SCOPE}/leader"  # Patroni's etcd3 layout
        body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
        request = urllib.request.Request(f"http://{self.etcd}/v3/kv/deleterange", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=5) as answer:
            deleted = int(json.load(answer).get("deleted", 0))
        if deleted != 1:
            raise PatroniError(f"no leader key {key} in the DCS to expire")
        say(f"leader key {key} deleted")


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by Patroni, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
