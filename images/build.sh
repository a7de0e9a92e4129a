#!/usr/bin/env bash
# `make images`: retex-operator and retex-worker from images/Dockerfile (docs/install.md).
# The base is the official slim Python image when it is present or a registry serves it; where no
# registry answers, a local base is made once from Debian packages (debootstrap against the mirror
# apt's own sources name) and kept in docker's image store, so later builds skip it.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[images $(date +%H:%M:%S)] $*"; }
TAG=${RETEX_IMAGE_TAG:-dev}
OFFICIAL_BASE=python:3.11-slim-bookworm
# bookworm's python3 is CPython 3.11, the version images/requirements.lock is resolved for.
BASE_RELEASE=${RETEX_BASE_RELEASE:-bookworm}
LOCAL_BASE=retex-python-base:$BASE_RELEASE

# The Dockerfile mounts the CA bundle as a build secret, which needs BuildKit: a client with the
# buildx plugin, or Debian's docker.io client (20.10), which has BuildKit built in.
pick_docker_cli() {
  if docker buildx version >/dev/null 2>&1; then echo docker
  elif [[ -x /usr/bin/docker && $(DOCKER_BUILDKIT=1 /usr/bin/docker build --help 2>&1) == *--secret* ]]; then
    echo /usr/bin/docker
  else
    echo "no docker client here builds with BuildKit (install buildx, or run images/docker-engine.sh)" >&2
    return 1
  fi
}
DOCKER=$(pick_docker_cli)
export DOCKER_BUILDKIT=1
if ! "$DOCKER" info >/dev/null 2>&1; then
  echo "docker info fails: no Docker engine answers (images/docker-engine.sh starts one)" >&2
  exit 1
fi

# The Debian mirror apt uses for $BASE_RELEASE: one-line sources ("deb [opts] URI SUITE ...") and
# deb822 stanzas ("URIs:" with "Suites:").
debian_mirror() {
  python3 - "$BASE_RELEASE" <<'EOF'
import glob, sys
release = sys.argv[1]
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]:
    try:
        text = open(path).read()
    except OSError:
        continue
    if path.endswith(".sources"):
        for stanza in text.split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.split()
            if "deb" in fields.get("types", []) and release in fields.get("suites", []):
                print(fields["uris"][0]); sys.exit(0)
    else:
        for line in text.splitlines():
            words = [w for w in line.split("#", 1)[0].split() if not w.startswith("[")]
            if len(words) >= 3 and words[0] == "deb" and words[2] == release:
                print(words[1]); sys.exit(0)
sys.exit(f"no apt source for {release} in /etc/apt/sources.list*")
EOF
}

build_local_base() {
  command -v debootstrap >/dev/null || { echo "debootstrap is missing (images/docker-engine.sh installs it)" >&2; exit 1; }
  local mirror root
  mirror=$(debian_mirror)
  root=$(mktemp -d /var/tmp/retex-base.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  log "no registry serves $OFFICIAL_BASE: building $LOCAL_BASE from Debian packages"
  log "debootstrap --variant=minbase $BASE_RELEASE from $mirror (a few minutes; progress below)"
  # python-is-python3: the Dockerfile calls `python`, as in the official image.
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    "$BASE_RELEASE" "$root" "$mirror" | grep --line-buffered -E '^I: (Retriev|Extract|Install|Configur|Base)' \
    | awk '{ n++ } /Base system installed/ || n % 25 == 1 { print "  " $0; fflush() }'
  # Nothing a container needs: apt's package lists and caches, docs, man pages, translations
  # (33 MB; the images log in English).
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
    "$root"/usr/share/locale/*
  log "docker import as $LOCAL_BASE"
  tar -C "$root" -c . | "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$root"
  trap - EXIT
}

if [[ -n ${PYTHON_IMAGE:-} ]]; then
  log "base: $PYTHON_IMAGE (PYTHON_IMAGE)"
elif "$DOCKER" image inspect "$OFFICIAL_BASE" >/dev/null 2>&1 \
     || timeout 60 "$DOCKER" pull -q "$OFFICIAL_BASE" >/dev/null 2>&1; then
  PYTHON_IMAGE=$OFFICIAL_BASE
  log "base: $PYTHON_IMAGE (official)"
else
  if "$DOCKER" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    log "no registry serves $OFFICIAL_BASE: using the local base $LOCAL_BASE (already built)"
  else
    build_local_base
  fi
  PYTHON_IMAGE=$LOCAL_BASE
fi

# pip inside the build must trust the CA bundle pip trusts on this host (PIP_CERT or pip's config:
# some networks reach PyPI through a TLS proxy). It is passed as a build secret: mounted for the
# pip step only, never stored in a layer.
secret_args=()
pip_cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
if [[ -n $pip_cert && -f $pip_cert ]]; then
  log "pip in the build trusts $pip_cert (build secret pip_cert)"
  secret_args=(--secret "id=pip_cert,src=$pip_cert")
fi

revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
for target in operator worker; do
  log "building retex-$target:$TAG (target $target)"
  "$DOCKER" build --progress=plain -f images/Dockerfile --target "$target" \
    --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --build-arg "REVISION=$revision" \
    "${secret_args[@]}" -t "retex-$target:$TAG" . 2>&1 \
    | { grep --line-buffered -E '^#[0-9]+ (\[|DONE|CACHED|ERROR)|ERROR|error' || true; }
done
"$DOCKER" image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "retex-(operator|worker):$TAG|$PYTHON_IMAGE" || true
