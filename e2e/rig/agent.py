"""A test node agent: a tiny process-based kubelet for the local rig.

    python -m e2e.rig.agent --node NAME --kubeconfig ADMIN_KUBECONFIG --state-dir DIR

It registers a Node, renews the node Lease and the Ready condition, and runs every Pod bound to
the node as local process groups (one per container), reporting pod status as the kubelet does.
There is no container isolation and no image: the "image" is the locally installed project (its
.venv/bin comes first on PATH). What is honoured is listed in docs/contributing/testing.md.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import logging
import os
import platform
import re
import signal
import stat
import subprocess
import threading
import time
import traceback
import uuid
from pathlib import Path

import urllib3
from kubernetes import client, config, watch

from e2e.rig import pki as pkilib
from e2e.rig import procs

REPO = Path(__file__).resolve().parents[2]
POD_PATH = f"{REPO / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
POD_IP = "127.0.0.1"
NOBODY = 65534
# Non-root pods must run the project's interpreter. Where it lives under a private directory (a
# pyenv under /root, mode 700), they get CAP_DAC_READ_SEARCH as an ambient capability: they can
# read what root can read, but still write only what their uid may (see docs/contributing/testing.md).
INTERPRETER = Path(os.path.realpath(REPO / ".venv" / "bin" / "python3"))
INTERPRETER_PRIVATE = any(d.exists() and not d.stat().st_mode & stat.S_IXOTH
                          for d in INTERPRETER.parents)
MIN_KILL_GRACE = 2  # the kubelet's minimum grace when a pod vanishes without graceful deletion
TOKEN_SECONDS = 86400  # pods get one token for their whole life (no rotation on the rig)
REQUEST_TIMEOUT = 15

log = logging.getLogger("agent")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def rfc3339(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def micro(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def retrying(what: str, fn, *, give_up: threading.Event | None = None):
    """Call `fn` until it does not fail with a connection error or a 5xx/429 (the API server may
    be restarting: a nemesis); other API errors propagate."""
    delay = 0.2
    while True:
        try:
            return fn()
        except client.ApiException as e:
            if e.status not in (0, 429, 500, 502, 503, 504):
                raise
            error = f"HTTP {e.status} {e.reason}"
        except (urllib3.exceptions.HTTPError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
        log.warning("%s failed (%s); retrying in %.1fs", what, error, delay)
        if give_up is None:
            time.sleep(delay)
        elif give_up.wait(delay):  # e.g. the pod vanished: nothing left to write
            return None
        delay = min(delay * 2, 2.0)


class ConfigError(Exception):
    """The pod cannot start yet (e.g. a referenced Secret is missing): CreateContainerConfigError."""


# ----- environment and security context, resolved as the kubelet would ------------------------

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known variables are replaced, unknown ones kept, $$ escapes."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, value)


def _field(pod: client.V1Pod, path: str) -> str:
    simple = {
        "metadata.name": pod.metadata.name,
        "metadata.namespace": pod.metadata.namespace,
        "metadata.uid": pod.metadata.uid,
        "spec.nodeName": pod.spec.node_name,
        "spec.serviceAccountName": pod.spec.service_account_name or "default",
        "status.podIP": POD_IP,
        "status.podIPs": POD_IP,
        "status.hostIP": POD_IP,
        "status.hostIPs": POD_IP,
    }
    if path in simple:
        return simple[path] or ""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (getattr(pod.metadata, m.group(1)) or {}).get(m.group(2), "")
    raise ConfigError(f"fieldRef {path!r} is not supported")


class Resolver:
    """Reads the Secrets and ConfigMaps a container's env refers to."""

    def __init__(self, core: client.CoreV1Api, namespace: str):
        self.core, self.namespace = core, namespace
        self._cache: dict[tuple[str, str], dict[str, str] | None] = {}

    def data(self, kind: str, name: str) -> dict[str, str] | None:
        key = (kind, name)
        if key not in self._cache:
            try:
                if kind == "secret":
                    obj = self.core.read_namespaced_secret(name, self.namespace,
                                                           _request_timeout=REQUEST_TIMEOUT)
                    self._cache[key] = {k: base64.b64decode(v).decode()
                                        for k, v in (obj.data or {}).items()}
                else:
                    obj = self.core.read_namespaced_config_map(name, self.namespace,
                                                               _request_timeout=REQUEST_TIMEOUT)
                    self._cache[key] = dict(obj.data or {})
            except client.ApiException as e:
                if e.status != 404:
                    raise
                self._cache[key] = None
        return self._cache[key]

    def key(self, kind: str, ref) -> str | None:
        data = self.data(kind, ref.name)
        if data is None or ref.key not in data:
            if ref.optional:
                return None
            missing = f'{kind} "{ref.name}"' + ("" if data is None else f' key "{ref.key}"')
            raise ConfigError(f"{missing} not found")
        return data[ref.key]


def container_env(pod: client.V1Pod, container: client.V1Container,
                  resolver: Resolver) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.env_from or []:
        prefix = source.prefix or ""
        ref, kind = ((source.config_map_ref, "configmap") if source.config_map_ref
                     else (source.secret_ref, "secret"))
        data = resolver.data(kind, ref.name)
        if data is None and not ref.optional:
            raise ConfigError(f'{kind} "{ref.name}" not found')
        env.update({prefix + k: v for k, v in (data or {}).items()})
    for var in container.env or []:
        source = var.value_from
        if source is None:
            env[var.name] = expand(var.value or "", env)
        elif source.field_ref is not None:
            env[var.name] = _field(pod, source.field_ref.field_path)
        elif source.secret_key_ref is not None:
            value = resolver.key("secret", source.secret_key_ref)
            if value is not None:
                env[var.name] = value
        elif source.config_map_key_ref is not None:
            value = resolver.key("configmap", source.config_map_key_ref)
            if value is not None:
                env[var.name] = value
        else:
            raise ConfigError(f"env {var.name}: only fieldRef, secretKeyRef and "
                              "configMapKeyRef are supported on the rig")
    return env


def mount_paths(env: dict[str, str], container: client.V1Container, dirs: dict[str, Path]) -> dict[str, str]:
    """Env values naming a path under a volume the rig wrote to a directory, pointed there."""
    mounts = [(m.mount_path.rstrip("/") + "/", dirs[m.name]) for m in container.volume_mounts or []
              if m.name in dirs]
    for name, value in env.items():
        for prefix, directory in mounts:
            if value.startswith(prefix):
                env[name] = str(directory / value[len(prefix):])
    return env


def run_as(pod: client.V1Pod, container: client.V1Container) -> tuple[int, int, list[int]] | None:
    """(uid, gid, supplementary groups) the container must run as, or None for "as the agent".

    Container securityContext overrides the pod's. runAsNonRoot without runAsUser means nobody
    (there is no image USER to check). With no runAsGroup the group is 0, as container runtimes do.
    """
    psc = pod.spec.security_context or client.V1PodSecurityContext()
    csc = container.security_context or client.V1SecurityContext()

    def pick(attr):
        value = getattr(csc, attr)
        return value if value is not None else getattr(psc, attr)

    uid, gid, non_root = pick("run_as_user"), pick("run_as_group"), pick("run_as_non_root")
    if non_root and uid == 0:
        raise ConfigError("container's runAsUser breaks non-root policy (runAsNonRoot with uid 0)")
    if uid is None and non_root:
        uid = NOBODY
    if uid is None:
        return None
    groups = list(psc.supplemental_groups or []) + ([psc.fs_group] if psc.fs_group else [])
    return uid, gid if gid is not None else 0, groups


# ----- one pod ---------------------------------------------------------------------------------


def unpullable_image(image: str | None) -> bool:
    """The rig has no images: an image whose registry is in the reserved `.invalid` domain
    (RFC 2606) stands for one that cannot be pulled, so tests can see ImagePullBackOff."""
    registry = (image or "").split("/")[0] if "/" in (image or "") else ""
    return registry.split(":")[0].endswith(".invalid")


class Container:
    """One running (or finished) container: a process group."""

    def __init__(self, spec: client.V1Container, restart_count: int = 0):
        self.spec = spec
        self.name = spec.name
        self.proc: subprocess.Popen | None = None
        self.started_at: datetime.datetime | None = None
        self.finished_at: datetime.datetime | None = None
        self.exit_code: int | None = None
        self.reason = ""
        self.message = ""
        self.restart_count = restart_count
        self.last_state: dict = {}

    def state(self) -> dict:
        if self.exit_code is not None:
            terminated = {"exitCode": self.exit_code, "reason": self.reason,
                          "startedAt": rfc3339(self.started_at or now()),
                          "finishedAt": rfc3339(self.finished_at or now())}
            if self.message:
                terminated["message"] = self.message
            if self.proc is not None:
                terminated["containerID"] = f"rig://{self.proc.pid}"
            return {"terminated": terminated}
        if self.proc is not None:
            return {"running": {"startedAt": rfc3339(self.started_at)}}
        return {"waiting": {"reason": self.reason or "ContainerCreating",
                            **({"message": self.message} if self.message else {})}}

    def status(self) -> dict:
        running = self.proc is not None and self.exit_code is None
        status = {
            "name": self.name, "image": self.spec.image or "", "imageID": "rig://local-project",
            "ready": running, "started": running, "restartCount": self.restart_count,
            "state": self.state(), "lastState": self.last_state,
        }
        if self.proc is not None:
            status["containerID"] = f"rig://{self.proc.pid}"
        return status


class PodWorker:
    """Runs one pod from binding to deletion on its own thread."""

    def __init__(self, agent: Agent, pod: client.V1Pod):
        self.agent = agent
        self.pod = pod
        self.uid = pod.metadata.uid
        self.namespace, self.name = pod.metadata.namespace, pod.metadata.name
        self.dir = agent.pods_dir / f"{self.namespace}_{self.name}_{self.uid}"
        self.deleting = threading.Event()  # graceful deletion requested (deletionTimestamp)
        self.vanished = threading.Event()  # the pod object is gone from the API
        self.containers: list[Container] = []
        self.init_containers: list[Container] = []
        self.start_time: datetime.datetime | None = None
        self.transitions: dict[str, tuple[str, str]] = {}  # condition -> (status, since)
        self.thread = threading.Thread(target=self._main, name=f"pod-{self.name}", daemon=True)
        self.update(pod)

    def update(self, pod: client.V1Pod) -> None:
        self.pod = pod
        if pod.metadata.deletion_timestamp is not None:
            self.deleting.set()

    def vanish(self) -> None:
        self.vanished.set()
        self.deleting.set()

    def _main(self) -> None:
        try:
            self._run()
        except Exception:
            # A rig bug. The dead worker stays registered as a tombstone, so later events for
            # this pod cannot start its command a second time.
            log.error("pod %s/%s: worker failed:\n%s", self.namespace, self.name,
                      traceback.format_exc())
            self._kill_all(signal.SIGKILL)
        else:
            self.agent.forget(self.uid)

    # -- API writes --

    def _patch_status(self, status: dict) -> None:
        if self.vanished.is_set():
            return
        try:
            retrying(f"status of {self.namespace}/{self.name}", lambda: self.agent.core.patch_namespaced_pod_status(
                self.name, self.namespace, {"metadata": {"uid": self.uid}, "status": status},
                _request_timeout=REQUEST_TIMEOUT), give_up=self.vanished)
        except client.ApiException as e:
            if e.status not in (404, 409):
                raise
            log.info("pod %s/%s gone before its status could be written", self.namespace, self.name)

    def _conditions(self, ready: bool, reason: str | None, initialized: bool) -> list[dict]:
        wanted = {"PodReadyToStartContainers": "True", "Initialized": str(initialized),
                  "ContainersReady": str(ready), "Ready": str(ready)}
        conditions = []
        for kind, status in wanted.items():
            # lastTransitionTime moves only when the status does, as the kubelet reports it.
            if self.transitions.get(kind, ("", ""))[0] != status:
                self.transitions[kind] = (status, rfc3339(now()))
            condition = {"type": kind, "status": status,
                         "lastTransitionTime": self.transitions[kind][1]}
            if reason and kind in ("ContainersReady", "Ready"):
                condition["reason"] = reason
            conditions.append(condition)
        return conditions

    def _report(self, phase: str, *, ready: bool = False, condition_reason: str | None = None,
                reason: str | None = None, message: str | None = None,
                initialized: bool = True) -> None:
        status = {
            "phase": phase, "hostIP": POD_IP, "hostIPs": [{"ip": POD_IP}],
            "podIP": POD_IP, "podIPs": [{"ip": POD_IP}],
            "startTime": rfc3339(self.start_time or now()),
            "conditions": self._conditions(ready, condition_reason, initialized),
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        if reason:
            status["reason"] = reason
        if message:
            status["message"] = message
        self._patch_status(status)

    def _delete_finally(self) -> None:
        """After the processes are gone: remove the pod object (grace 0, same UID only)."""
        if self.vanished.is_set():
            return
        body = client.V1DeleteOptions(grace_period_seconds=0,
                                      preconditions=client.V1Preconditions(uid=self.uid))
        try:
            retrying(f"delete {self.namespace}/{self.name}", lambda: self.agent.core.delete_namespaced_pod(
                self.name, self.namespace, body=body, _request_timeout=REQUEST_TIMEOUT),
                give_up=self.vanished)
            log.info("pod %s/%s deleted", self.namespace, self.name)
        except client.ApiException as e:
            if e.status not in (404, 409):
                raise

    def _wait_for_deletion_then_delete(self) -> None:
        self.deleting.wait()
        self._delete_finally()

    # -- lifecycle --

    def _run(self) -> None:
        pod = self.pod
        phase = pod.status.phase if pod.status else None
        if phase in ("Succeeded", "Failed"):
            return self._wait_for_deletion_then_delete()
        if self.deleting.is_set():  # deleted before it ever ran here
            return self._delete_finally()
        self.containers = [Container(c) for c in pod.spec.containers]
        self.init_containers = [Container(c) for c in pod.spec.init_containers or []]
        if any(s.state and (s.state.running or s.state.terminated)
               for s in (pod.status.container_statuses or [])):
            # Started by an earlier incarnation of this node whose processes died with it (node
            # loss, then restart_node): report them lost, as the kubelet does after a reboot.
            for c in self.containers:
                c.exit_code, c.reason = 137, "ContainerStatusUnknown"
                c.message = "The container could not be located when the pod was terminated"
            self.start_time = pod.status.start_time
            self._report("Failed")
            return self._wait_for_deletion_then_delete()

        self.start_time = now()
        unpullable = [c for c in self.containers + self.init_containers if unpullable_image(c.spec.image)]
        if unpullable:
            return self._fail_to_pull(unpullable)
        prepared = self._prepare_until_ready()
        if prepared is None:
            return self._delete_finally()
        ok = self._run_init_containers(prepared)
        if ok:
            self._run_containers(prepared)
        self._wait_for_deletion_then_delete()

    def _fail_to_pull(self, containers: list[Container]) -> None:
        """What the kubelet reports for an image it cannot pull: ErrImagePull, then ImagePullBackOff,
        until the pod is deleted. Nothing runs."""
        reason = "ErrImagePull"
        while not self.deleting.is_set():
            for c in containers:
                c.reason = reason
                c.message = f'Back-off pulling image "{c.spec.image}": the rig never resolves the .invalid domain'
            self._report("Pending")
            reason = "ImagePullBackOff"
            self.deleting.wait(2.0)
        self._delete_finally()

    def _prepare_until_ready(self) -> dict | None:
        """Resolve env, token and user; while that fails, report CreateContainerConfigError."""
        while not self.deleting.is_set():
            try:
                return self._prepare()
            except ConfigError as e:
                log.info("pod %s/%s cannot start yet: %s", self.namespace, self.name, e)
                for c in self.containers:
                    c.reason, c.message = "CreateContainerConfigError", str(e)
                self._report("Pending")
            self.deleting.wait(2.0)
        return None

    def _prepare(self) -> dict:
        pod = self.pod
        self.dir.mkdir(parents=True, exist_ok=True)
        resolver = Resolver(self.agent.core, self.namespace)
        base = {
            "PATH": POD_PATH, "HOME": str(self.dir), "HOSTNAME": self.name,
            "LANG": "C.UTF-8", "RETEX_RIG_POD_DIR": str(self.dir),
        }
        if self._has_token_volume():
            base["KUBECONFIG"] = str(self._write_kubeconfig())
        audience_mounts = self._write_audience_tokens()
        plan = {}
        for c in (pod.spec.init_containers or []) + pod.spec.containers:
            env = mount_paths(base | container_env(pod, c, resolver), c, audience_mounts)
            user = run_as(pod, c)
            if os.geteuid() != 0:  # only root can switch users: run as the agent's user
                user = None
            argv = [expand(a, env) for a in (c.command or []) + (c.args or [])]
            if not c.command:
                raise ConfigError(f"container {c.name} has no command: the rig has no images "
                                  "and so no image entrypoint")
            plan[c.name] = (argv, env, user)
        owners = {u[:2] for _, _, u in plan.values() if u is not None}
        if len(owners) == 1:  # the pod's user owns its working directory, as with fsGroup
            uid, gid = owners.pop()
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, uid, gid)
        return plan

    def _has_token_volume(self) -> bool:
        # The ServiceAccount admission plugin adds a projected token volume unless
        # automountServiceAccountToken is false: the kubeconfig is the rig's equivalent.
        return any(v.projected and any(s.service_account_token for s in v.projected.sources or [])
                   for v in self.pod.spec.volumes or [])

    def _write_audience_tokens(self) -> dict[str, Path]:
        """Projected volumes of ServiceAccount tokens for an audience (not the API server's): each
        token becomes a file under the pod's directory, bound to the pod as the kubelet binds it.
        Returns volume name → that directory; the rig has no mounts, so `mount_paths` points env
        values naming a file under the volume's mountPath there instead."""
        dirs: dict[str, Path] = {}
        for volume in self.pod.spec.volumes or []:
            sources = [s.service_account_token for s in (volume.projected.sources or [])
                       if s.service_account_token and s.service_account_token.audience] if volume.projected else []
            for source in sources:
                directory = self.dir / "volumes" / volume.name
                directory.mkdir(parents=True, exist_ok=True)
                token = self._token_request([source.audience], source.expiration_seconds or 3600)
                (directory / source.path).write_text(token)
                dirs[volume.name] = directory
        return dirs

    def _token_request(self, audiences: list[str], seconds: int) -> str:
        sa = self.pod.spec.service_account_name or "default"
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": audiences, "expirationSeconds": seconds,
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid}}}
        try:
            result = retrying(f"token for {self.namespace}/{sa}", lambda: self.agent.core.create_namespaced_service_account_token(
                sa, self.namespace, request, _request_timeout=REQUEST_TIMEOUT))
        except client.ApiException as e:
            raise ConfigError(f"TokenRequest for service account {sa} failed: {e.reason}") from e
        return result.status.token

    def _write_kubeconfig(self) -> Path:
        sa = self.pod.spec.service_account_name or "default"
        return pkilib.write_kubeconfig(self.dir / "kubeconfig", self.agent.server,
                                       self.agent.ca_crt, user=f"{self.namespace}:{sa}",
                                       token=self._token_request([], TOKEN_SECONDS))

    def _start(self, c: Container, plan: dict) -> None:
        argv, env, user = plan[c.name]
        spec = c.spec
        if user is not None:
            uid, gid, groups = user
            sc = spec.security_context
            argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                    f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
                    *(["--no-new-privs"] if sc and sc.allow_privilege_escalation is False else []),
                    *(["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
                      if INTERPRETER_PRIVATE and uid != 0 else []),
                    "--", *argv]
        workdir = spec.working_dir if spec.working_dir and os.path.isdir(spec.working_dir) else self.dir
        log_path = self.dir / f"{c.name}.log"
        with open(log_path, "ab") as out:
            try:
                c.proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            except OSError as e:
                c.exit_code, c.reason, c.message = 128, "StartError", str(e)
                c.started_at = c.finished_at = now()
                return
        if user is not None:
            os.chown(log_path, user[0], user[1])
        procs.record(self.dir / f"{c.name}.pid", c.proc.pid)
        c.started_at, c.exit_code, c.reason, c.message = now(), None, "", ""
        log.info("pod %s/%s container %s started: pid %d %s", self.namespace, self.name, c.name,
                 c.proc.pid, argv)

    def _reap(self, c: Container) -> bool:
        """Record the exit of `c` if its main process ended; kill what it left in its group."""
        if c.proc is None or c.exit_code is not None:
            return c.exit_code is not None
        code = c.proc.poll()
        if code is None:
            return False
        procs.signal_group(c.proc.pid, signal.SIGKILL)  # a container ends with its main process
        (self.dir / f"{c.name}.pid").unlink(missing_ok=True)
        c.exit_code = 128 - code if code < 0 else code  # killed by signal N -> 128+N
        c.reason = "Completed" if c.exit_code == 0 else "Error"
        c.finished_at = now()
        log.info("pod %s/%s container %s exited with %d", self.namespace, self.name, c.name,
                 c.exit_code)
        return True

    def _kill_all(self, sig: int) -> None:
        for c in self.containers + self.init_containers:
            if c.proc is not None and c.exit_code is None:
                procs.signal_group(c.proc.pid, sig)

    def _grace(self) -> int:
        meta, spec = self.pod.metadata, self.pod.spec
        if self.vanished.is_set():
            return MIN_KILL_GRACE
        if meta.deletion_grace_period_seconds is not None:
            return max(meta.deletion_grace_period_seconds, 0)
        return spec.termination_grace_period_seconds if spec.termination_grace_period_seconds is not None else 30

    def _run_init_containers(self, plan: dict) -> bool:
        for c in self.init_containers:
            self._start(c, plan)
            self._report("Pending", initialized=False)
            while not self._reap(c):
                if self.deleting.is_set():
                    self._terminate([c])
                time.sleep(0.1)
            if c.exit_code != 0 or self.deleting.is_set():
                for main in self.containers:
                    main.reason = "PodInitializing"
                self._report("Failed", condition_reason="PodFailed", initialized=False)
                return False
        return True

    def _terminate(self, containers: list[Container]) -> None:
        """SIGTERM, wait the grace period (re-read: a later delete may shorten it), SIGKILL.

        As with container runtimes, SIGTERM goes to the main process only and SIGKILL to all.
        """
        for c in containers:
            if c.exit_code is None and c.proc is not None:
                c.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        log.info("pod %s/%s: SIGTERM sent, grace %ds", self.namespace, self.name, self._grace())
        while not all(self._reap(c) for c in containers if c.proc is not None):
            if time.monotonic() - sent >= self._grace():
                log.info("pod %s/%s: grace period over, SIGKILL", self.namespace, self.name)
                for c in containers:
                    if c.exit_code is None and c.proc is not None:
                        procs.signal_group(c.proc.pid, signal.SIGKILL)
            time.sleep(0.05)

    def _run_containers(self, plan: dict) -> None:
        spec = self.pod.spec
        for c in self.containers:
            self._start(c, plan)
        self._report("Running", ready=True)
        started = time.monotonic()
        restart_at: dict[str, float] = {}
        deadline_reason = None
        while True:
            changed = False
            for c in self.containers:
                if c.exit_code is None and self._reap(c):
                    changed = True
                    if self._should_restart(c) and not self.deleting.is_set():
                        delay = min(10.0, 0.5 * 2 ** c.restart_count)
                        restart_at[c.name] = time.monotonic() + delay
                        c.last_state = c.state()
                        c.proc, c.exit_code = None, None
                        c.reason = "CrashLoopBackOff"
                        c.message = f"back-off {delay:g}s restarting failed container={c.name}"
            for c in self.containers:
                if c.name in restart_at and time.monotonic() >= restart_at[c.name]:
                    del restart_at[c.name]
                    c.restart_count += 1
                    self._start(c, plan)
                    changed = True
            if self.deleting.is_set():
                restart_at.clear()
                self._terminate(self.containers)
                break
            if (spec.active_deadline_seconds is not None and deadline_reason is None
                    and time.monotonic() - started >= spec.active_deadline_seconds):
                deadline_reason = "DeadlineExceeded"
                restart_at.clear()
                self._terminate(self.containers)
                break
            if not restart_at and all(c.exit_code is not None for c in self.containers):
                break
            if changed:
                running = all(c.proc is not None and c.exit_code is None for c in self.containers)
                self._report("Running", ready=running)
            time.sleep(0.1)

        succeeded = all(c.exit_code == 0 for c in self.containers) and deadline_reason is None
        self._report(
            "Succeeded" if succeeded else "Failed",
            condition_reason="PodCompleted" if succeeded else "PodFailed",
            reason=deadline_reason,
            message="Pod was active on the node longer than the specified deadline"
            if deadline_reason else None,
        )

    def _should_restart(self, c: Container) -> bool:
        policy = self.pod.spec.restart_policy or "Always"
        return policy == "Always" or (policy == "OnFailure" and c.exit_code != 0)


# ----- the node --------------------------------------------------------------------------------


class Agent:
    def __init__(self, node: str, kubeconfig: Path, state_dir: Path,
                 lease_renew_seconds: float, status_heartbeat_seconds: float):
        self.node = node
        self.state_dir = state_dir
        self.pods_dir = state_dir / "nodes" / node / "pods"
        self.ca_crt = state_dir / "pki" / "ca.crt"
        self.lease_renew_seconds = lease_renew_seconds
        self.status_heartbeat_seconds = status_heartbeat_seconds
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = 32  # one connection per busy pod worker thread
        self.server = configuration.host
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        self.boot_id = str(uuid.uuid4())

    def run(self) -> None:
        self._kill_leftovers()
        node = retrying("register node", self._register)
        threading.Thread(target=self._heartbeat, args=(node.metadata.uid,), name="heartbeat",
                         daemon=True).start()
        self._watch_pods()

    def _kill_leftovers(self) -> None:
        # A restarted node runs no containers: whatever an earlier agent left is killed.
        for record in self.pods_dir.glob("*/*.pid"):
            if procs.stop(record, sig=signal.SIGKILL):
                log.info("killed leftover process of %s", record.parent.name)

    def _node_status(self) -> dict:
        t = rfc3339(now())
        resources = {"cpu": "8", "memory": "16Gi", "pods": "110", "ephemeral-storage": "100Gi"}
        conditions = [
            {"type": kind, "status": "False", "reason": f"KubeletHas{reason}",
             "lastHeartbeatTime": t, "lastTransitionTime": t}
            for kind, reason in (("MemoryPressure", "SufficientMemory"),
                                 ("DiskPressure", "NoDiskPressure"),
                                 ("PIDPressure", "SufficientPID"))
        ] + [{"type": "Ready", "status": "True", "reason": "KubeletReady",
              "message": "retex rig node agent is posting ready status",
              "lastHeartbeatTime": t, "lastTransitionTime": t}]
        return {
            "capacity": resources, "allocatable": resources, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": POD_IP},
                          {"type": "Hostname", "address": self.node}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": self.node, "systemUUID": self.node, "bootID": self.boot_id,
                "kernelVersion": platform.release(), "osImage": "retex local rig",
                "containerRuntimeVersion": "rig://0.1", "kubeletVersion": "v1.37.2-rig",
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
        }

    def _register(self) -> client.V1Node:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": {
            "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64", "retex.dev/rig-node": "true"}}}
        try:
            self.core.create_node(body, _request_timeout=REQUEST_TIMEOUT)
            log.info("node %s registered", self.node)
        except client.ApiException as e:
            if e.status != 409:
                raise
            log.info("node %s exists: taking it over", self.node)
        return self.core.patch_node_status(self.node, {"status": self._node_status()},
                                           _request_timeout=REQUEST_TIMEOUT)

    def _heartbeat(self, node_uid: str) -> None:
        last_status = time.monotonic()
        while True:
            try:
                self._renew_lease(node_uid)
                if time.monotonic() - last_status >= self.status_heartbeat_seconds:
                    t = rfc3339(now())
                    self.core.patch_node_status(self.node, {"status": {"conditions": [
                        {"type": "Ready", "status": "True", "reason": "KubeletReady",
                         "lastHeartbeatTime": t}]}}, _request_timeout=REQUEST_TIMEOUT)
                    last_status = time.monotonic()
            except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as e:
                log.warning("heartbeat failed: %s", getattr(e, "reason", e))
            except Exception:  # never let the heartbeat die silently: that would be node loss
                log.exception("heartbeat failed unexpectedly")
            time.sleep(self.lease_renew_seconds)

    def _renew_lease(self, node_uid: str) -> None:
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                "renewTime": micro(now())}
        try:
            self.coordination.patch_namespaced_lease(self.node, "kube-node-lease", {"spec": spec},
                                                     _request_timeout=REQUEST_TIMEOUT)
        except client.ApiException as e:
            if e.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.node, "namespace": "kube-node-lease", "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node_uid}]},
                "spec": spec}, _request_timeout=REQUEST_TIMEOUT)

    # -- pods --

    def forget(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)

    def _on_pod(self, pod: client.V1Pod) -> None:
        with self.lock:
            worker = self.workers.get(pod.metadata.uid)
            if worker is None:
                worker = self.workers[pod.metadata.uid] = PodWorker(self, pod)
                worker.thread.start()
            else:
                worker.update(pod)

    def _on_pod_gone(self, uid: str) -> None:
        with self.lock:
            worker = self.workers.get(uid)
            if worker is not None and not worker.thread.is_alive():
                del self.workers[uid]  # a tombstone: its pod is gone now
        if worker is not None:
            worker.vanish()

    def _watch_pods(self) -> None:
        selector = f"spec.nodeName={self.node}"
        version = None
        while True:
            try:
                if version is None:
                    listed = self.core.list_pod_for_all_namespaces(
                        field_selector=selector, _request_timeout=REQUEST_TIMEOUT)
                    version = listed.metadata.resource_version
                    present = {p.metadata.uid for p in listed.items}
                    with self.lock:
                        missing = set(self.workers) - present
                    for uid in missing:  # deleted while we were not watching
                        self._on_pod_gone(uid)
                    for pod in listed.items:
                        self._on_pod(pod)
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces, field_selector=selector,
                    resource_version=version, allow_watch_bookmarks=True, timeout_seconds=60,
                    _request_timeout=90)
                for event in stream:
                    version = event["raw_object"]["metadata"]["resourceVersion"]
                    if event["type"] == "BOOKMARK":  # the object is a bare dict: nothing to do
                        continue
                    pod = event["object"]
                    if event["type"] == "DELETED":
                        self._on_pod_gone(pod.metadata.uid)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._on_pod(pod)
            except client.ApiException as e:
                if e.status == 410:  # our resourceVersion is too old: list again
                    version = None
                    continue
                log.warning("pod watch failed: HTTP %s %s", e.status, e.reason)
                time.sleep(1)
            except (urllib3.exceptions.HTTPError, OSError) as e:
                log.warning("pod watch interrupted: %s", e)
                time.sleep(1)
            except Exception:  # a bug here must not look like node loss: log, relist, go on
                log.exception("pod watch failed unexpectedly; listing again")
                version = None
                time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--lease-renew-seconds", type=float, default=2.0)
    parser.add_argument("--status-heartbeat-seconds", type=float, default=4.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {args.node} %(threadName)s %(levelname)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # retries are logged by the agent itself
    Agent(args.node, args.kubeconfig, args.state_dir,
          args.lease_renew_seconds, args.status_heartbeat_seconds).run()


if __name__ == "__main__":
    main()
