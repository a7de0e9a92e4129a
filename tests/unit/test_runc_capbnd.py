"""images/runc-capbnd, the runc wrapper for hosts whose capability bounding set is reduced: it must
drop exactly the capabilities outside the bounding set it runs under, from the spec runc is about
to apply, and hand runc its arguments unchanged. Run with a capability dropped from its bounding
set by `setpriv` (root only, as CI runs), and a stand-in `runc` first on PATH that records what
it was given; bash and jq only, as in a kind node."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "images" / "runc-capbnd"
EVERY_CAP = [f"CAP_{name}" for name in (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO "
    "SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME "
    "SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG "
    "WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE").split()]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="setpriv --bounding-set needs root (CI runs as root)")


def outside_bounding_set_here() -> set[str]:
    status = Path("/proc/self/status").read_text()
    bounding = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapBnd:")), 16)
    return {name for bit, name in enumerate(EVERY_CAP) if not bounding >> bit & 1}


def run_wrapper(tmp_path: Path, *args: str, check: bool = True) -> list[str]:
    """Runs the wrapper, as dockerd and containerd do (its own file, shebang and mode), with
    CAP_SYS_TIME also out of its bounding set; returns runc's arguments (none if not called)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorded = tmp_path / "runc-args"
    (bin_dir / "runc").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {recorded}\n")
    (bin_dir / "runc").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    result = subprocess.run(["setpriv", "--bounding-set", "-sys_time", str(WRAPPER), *args],
                            capture_output=True, text=True, env=env, timeout=30)
    if check:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
    return recorded.read_text().splitlines() if recorded.exists() else []


def capabilities() -> dict[str, list[str]]:
    return {kind: list(EVERY_CAP) for kind in ("bounding", "effective", "permitted", "inheritable", "ambient")}


def expected_after() -> list[str]:
    removed = outside_bounding_set_here() | {"CAP_SYS_TIME"}
    return [name for name in EVERY_CAP if name not in removed]


@pytest.fixture(autouse=True)
def tools():
    for tool in ("setpriv", "jq"):
        assert shutil.which(tool), f"{tool} is missing: .ci/run installs it (util-linux, jq)"


@pytest.mark.parametrize("bundle_args", [["--bundle", "{b}"], ["-b", "{b}"], ["--bundle={b}"]])
def test_create_drops_the_capabilities_outside_the_bounding_set_from_the_bundle(tmp_path, bundle_args):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    spec = {"ociVersion": "1.2.0", "process": {"args": ["/pause"], "capabilities": capabilities()},
            "root": {"path": "rootfs"}}
    (bundle / "config.json").write_text(json.dumps(spec))
    args = ["--root", "/run/runc", "create", *[a.format(b=bundle) for a in bundle_args], "c1"]

    assert run_wrapper(tmp_path, *args) == args
    written = json.loads((bundle / "config.json").read_text())
    assert written["process"]["capabilities"] == {kind: expected_after() for kind in capabilities()}
    assert {k: v for k, v in written.items() if k != "process"} == {k: v for k, v in spec.items() if k != "process"}
    assert written["process"]["args"] == ["/pause"]


@pytest.mark.parametrize("process_args", [["--process", "{p}"], ["-p", "{p}"], ["--process={p}"]])
def test_exec_drops_them_from_the_process_file(tmp_path, process_args):
    process_file = tmp_path / "process.json"
    process_file.write_text(json.dumps({"args": ["sh"], "capabilities": capabilities()}))
    args = ["--root", "/run/runc", "--log", "/run/log.json", "--systemd-cgroup", "exec",
            *[a.format(p=process_file) for a in process_args], "--detach", "c1"]

    assert run_wrapper(tmp_path, *args) == args
    assert json.loads(process_file.read_text()) == {
        "args": ["sh"], "capabilities": {kind: expected_after() for kind in capabilities()}}


def test_a_spec_without_capabilities_and_other_commands_pass_through(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    spec = {"process": {"args": ["/pause"]}}
    (bundle / "config.json").write_text(json.dumps(spec))

    assert run_wrapper(tmp_path, "run", "--bundle", str(bundle), "c1") == ["run", "--bundle", str(bundle), "c1"]
    assert json.loads((bundle / "config.json").read_text()) == spec
    assert run_wrapper(tmp_path, "state", "c1") == ["state", "c1"]


def test_the_command_is_the_first_argument_that_is_no_option(tmp_path):
    """`runc delete run`: a container named `run` is deleted, no bundle is rewritten."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    spec = {"process": {"capabilities": capabilities()}}
    (bundle / "config.json").write_text(json.dumps(spec))
    assert run_wrapper(tmp_path, "--root", "run", "delete", "--bundle", str(bundle), "run") == [
        "--root", "run", "delete", "--bundle", str(bundle), "run"]
    assert json.loads((bundle / "config.json").read_text()) == spec


def test_a_bundle_it_cannot_read_stops_it_before_runc(tmp_path):
    # Fail closed: runc given the unstripped spec would fail anyway, later and less clearly.
    assert run_wrapper(tmp_path, "create", "--bundle", str(tmp_path / "missing"), "c1", check=False) == []
