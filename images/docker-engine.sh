#!/usr/bin/env bash
# A Docker engine on a machine that has none (docs/contributing/development.md, "Docker engine").
# Idempotent: when `docker info` already answers, it does nothing. Otherwise, as root: installs Debian's docker.io
# (and debootstrap, which images/build.sh needs when no registry serves a Python base, and jq), starts
# dockerd in the background (these machines have no systemd) with its log in
# $RETEX_DOCKERD_LOG, and waits until `docker info` answers.
set -euo pipefail

log() { echo "[docker-engine $(date +%H:%M:%S)] $*"; }
LOG_FILE=${RETEX_DOCKERD_LOG:-/var/log/retex-dockerd.log}
WAIT_SECONDS=${RETEX_DOCKERD_WAIT:-60}

# The engine package's own client: it builds with BuildKit without the buildx plugin, which a
# newer client found first on PATH may lack (images/build.sh prefers a client that can).
docker_cli() { if [[ -x /usr/bin/docker ]]; then echo /usr/bin/docker; else echo docker; fi; }

if "$(docker_cli)" info >/dev/null 2>&1; then
  log "docker info answers: engine already running"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "docker info fails and this is not root: start a Docker engine yourself (docs/contributing/development.md)" >&2
  exit 1
fi

# jq: images/runc-capbnd, the runtime wrapper below, edits OCI specs with it.
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v jq >/dev/null; then
  log "installing docker.io, debootstrap and jq from Debian (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap jq >/dev/null
fi

# Only on hosts whose capability bounding set is reduced: a --privileged container asks for every
# capability the kernel knows, and runc fails with "unable to apply caps: operation not
# permitted" for those outside the bounding set. The wrapper removes them from the OCI spec first.
bounding=$((16#$(awk '/^CapBnd:/ {print $2}' /proc/self/status)))
last_cap=$(cat /proc/sys/kernel/cap_last_cap)
if (( bounding != (1 << (last_cap + 1)) - 1 )); then
  log "capability bounding set is reduced ($(printf '%x' "$bounding")): registering runtime runc-capbnd"
  install -m 0755 "$(dirname "$0")/runc-capbnd" /usr/local/sbin/runc-capbnd
  mkdir -p /etc/docker
  python3 - <<'EOF'
import json, pathlib
path = pathlib.Path("/etc/docker/daemon.json")
config = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else {}
config.setdefault("runtimes", {})["runc-capbnd"] = {"path": "/usr/local/sbin/runc-capbnd"}
# The default too: kind creates its node containers with --privileged and no --runtime option.
# For any other container it changes nothing: runc could not grant the removed capabilities.
config["default-runtime"] = "runc-capbnd"
path.write_text(json.dumps(config, indent=2) + "\n")
EOF
fi

log "starting dockerd (log: $LOG_FILE)"
nohup dockerd >>"$LOG_FILE" 2>&1 &
for ((waited = 0; waited < WAIT_SECONDS; waited++)); do
  if "$(docker_cli)" info >/dev/null 2>&1; then
    log "dockerd answers after ${waited}s: $("$(docker_cli)" info --format '{{.ServerVersion}} {{.Driver}} cgroup v{{.CgroupVersion}}')"
    exit 0
  fi
  (( waited % 5 == 0 )) && log "waiting for dockerd (${waited}s)"
  sleep 1
done
echo "dockerd did not answer in ${WAIT_SECONDS}s; the end of $LOG_FILE:" >&2
tail -20 "$LOG_FILE" >&2
exit 1
