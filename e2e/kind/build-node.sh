#!/usr/bin/env bash
# A kind node image built on this machine, for hosts where kind's own (kindest/node) cannot be
# pulled (docs/contributing/development.md, "A kind cluster where kindest/node cannot be pulled").
# Prints progress on stderr and, last on stdout, the node image to give `kind create cluster --image`.
#
#   kind            $RETEX_CACHE/bin/kind-<v>/kind, `go install sigs.k8s.io/kind@<v>`
#   node binaries   kubelet, kubeadm, kubectl, kube-proxy from the rig's k8s.io/kubernetes module
#                   (e2e/rig/gobuild/kubernetes); the control plane's binaries and etcd from
#                   e2e/rig/build.sh's cache
#   runtime         containerd, crictl, CNI plugins from their Go modules; runc from Debian; a
#                   static pause built with the host's C compiler (e2e/kind/pause.c)
#   base image      e2e/kind/Dockerfile.base on the project's local Debian base (images/build.sh)
#   node image      kind's own node-image steps (its nodeimage package) done here: binaries into
#                   the base, component images (FROM scratch) imported into the node's containerd
#
# Everything is cached under $RETEX_CACHE/kind-node-<versions>/ and in docker's image store as
# retex-kind-node:<kubernetes version>; a warm run prints the image at once. Where kind's default
# node image is present or can be pulled, that image is printed and nothing is built.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${RETEX_CACHE:-$HOME/.cache/retex}

KIND_VERSION=v0.33.0
CONTAINERD_VERSION=v2.4.2
CRICTL_VERSION=v1.37.0
CNI_PLUGINS_VERSION=v1.10.0
LOCAL_PATH_VERSION=v0.0.30  # rancher's local-path-provisioner, kind's default storage
k8s_version=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$repo/e2e/rig/gobuild/kubernetes/go.mod")
etcd_version=$(awk '$1=="require" && $2=="go.etcd.io/etcd/server/v3" {print $3}' "$repo/e2e/rig/gobuild/etcd/go.mod")
key=k8s-$k8s_version-containerd-$CONTAINERD_VERSION-crictl-$CRICTL_VERSION-cni-$CNI_PLUGINS_VERSION-kind-$KIND_VERSION
out=$cache/kind-node-$key
# The images are rebuilt when what goes into them here changes (the binaries are keyed by version).
recipe=$(cat "$here"/{build-node.sh,Dockerfile.base,node-cni.sh,node-cni.service,pause.c} | sha256sum | cut -c1-12)
kind_dir=$cache/bin/kind-$KIND_VERSION
NODE_IMAGE=retex-kind-node:$k8s_version
BASE_IMAGE=retex-kind-base:$k8s_version
PYTHON_BASE=retex-python-base:bookworm  # images/build.sh's local Debian base

# Builds need BuildKit: the first docker on PATH if it has buildx, else Debian's docker.io client,
# which has it built in (as images/build.sh picks).
DOCKER=docker
if ! docker buildx version >/dev/null 2>&1 && [[ -x /usr/bin/docker ]]; then DOCKER=/usr/bin/docker; fi
export DOCKER_BUILDKIT=1

log() { echo "[kind-node $(date +%H:%M:%S)] $*" >&2; }
export CGO_ENABLED=0

progress() {  # turns `go build -v` package lines into a periodic count
  local what=$1 start=$SECONDS n=0
  while IFS= read -r line; do
    case $line in
      \#*|go:*|*.go:[0-9]*) echo "$line" >&2 ;;
      *) n=$((n + 1)); if (( n % 100 == 0 )); then log "  [$what] $n packages compiled, $((SECONDS - start))s"; fi ;;
    esac
  done
  log "  [$what] done: $n packages, $((SECONDS - start))s"
}

mkdir -p "$cache/bin"
exec 9>"$cache/.kind-node.lock"
flock -n 9 || { log "another kind node build is running: waiting for it"; flock 9; }

build_kind() {
  [[ -x $kind_dir/kind ]] && return 0
  log "building kind $KIND_VERSION (go install, ~1 min cold)"
  rm -rf "$kind_dir.partial"; mkdir -p "$kind_dir.partial"
  GOBIN=$kind_dir.partial go install -v -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION" 2>&1 | progress kind
  [[ ${PIPESTATUS[0]} == 0 ]] || { log "kind build failed"; return 1; }
  rm -rf "$kind_dir"; mv "$kind_dir.partial" "$kind_dir"
}
build_kind
kind_src=$(go env GOMODCACHE)/sigs.k8s.io/kind@$KIND_VERSION
[[ -d $kind_src ]] || go mod download "sigs.k8s.io/kind@$KIND_VERSION"

# kind's default node image: used as it is when docker has it or can pull it.
default_image=$(sed -n 's/^const Image = "\(.*\)"/\1/p' "$kind_src/pkg/apis/config/defaults/image.go")
if docker image inspect "$default_image" >/dev/null 2>&1 || timeout 60 docker pull -q "$default_image" >/dev/null 2>&1; then
  log "kind's node image $default_image is available: nothing to build"
  echo "$default_image"
  exit 0
fi
if [[ $(docker image inspect -f '{{index .Config.Labels "dev.retex.kind-node"}}' "$NODE_IMAGE" 2>/dev/null) == "$key-$recipe" ]]; then
  log "$NODE_IMAGE is built ($key, recipe $recipe)"
  echo "$NODE_IMAGE"
  exit 0
fi
log "no registry serves $default_image: building $NODE_IMAGE ($key)"

go_install() {  # go_install <dir> <what> <ldflags> <package@version>...
  local dir=$1 what=$2 ldflags=$3; shift 3
  [[ -d $dir ]] && return 0
  log "building $what from Go modules"
  rm -rf "$dir.partial"; mkdir -p "$dir.partial"
  GOBIN=$dir.partial go install -v -trimpath -tags "no_btrfs no_devmapper no_zfs no_aufs" -ldflags "-s -w $ldflags" "$@" 2>&1 | progress "$what"
  [[ ${PIPESTATUS[0]} == 0 ]] || { log "$what build failed"; return 1; }
  mv "$dir.partial" "$dir"
}

build_node_binaries() {  # kubelet, kubeadm, kubectl, kube-proxy: the rig's module, its ldflags
  local dir=$out/kubernetes
  [[ -d $dir ]] && return 0
  log "building kubelet, kubeadm, kubectl, kube-proxy $k8s_version (3.5 min measured with the rig's build cache warm)"
  rm -rf "$dir.partial" "$out/gobuild"; mkdir -p "$dir.partial"
  # A copy of the rig's build module: `-mod=mod` may add to its go.sum for these commands.
  cp -r "$repo/e2e/rig/gobuild/kubernetes" "$out/gobuild"
  local minor=${k8s_version#v1.}; minor=${minor%%.*}
  local pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"
  (cd "$out/gobuild" && GOFLAGS=-mod=mod go build -v -trimpath -ldflags "$ldflags" -o "$dir.partial/" \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubeadm k8s.io/kubernetes/cmd/kubectl \
      k8s.io/kubernetes/cmd/kube-proxy) 2>&1 | progress kubernetes
  [[ ${PIPESTATUS[0]} == 0 ]] || { log "kubernetes build failed"; return 1; }
  rm -rf "$out/gobuild"; mv "$dir.partial" "$dir"
}

mkdir -p "$out"
build_node_binaries
bash "$repo/e2e/rig/build.sh" etcd kubernetes >&2  # the control plane's binaries, cached by the rig
go_install "$out/containerd" containerd "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION"
go_install "$out/crictl" crictl "-X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
  "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
cni=github.com/containernetworking/plugins/plugins
go_install "$out/cni" "CNI plugins" "" "$cni/ipam/host-local@$CNI_PLUGINS_VERSION" \
  "$cni/main/loopback@$CNI_PLUGINS_VERSION" "$cni/main/ptp@$CNI_PLUGINS_VERSION" \
  "$cni/meta/portmap@$CNI_PLUGINS_VERSION"
kubeadm_images=$("$out/kubernetes/kubeadm" config images list --kubernetes-version "$k8s_version" 2>/dev/null)
image_for() { grep -E "/$1:" <<<"$kubeadm_images"; }
coredns_version=$(image_for coredns | sed 's/.*://')
go_install "$out/coredns-$coredns_version" "CoreDNS $coredns_version (a few minutes cold)" "" \
  "github.com/coredns/coredns@$coredns_version"
go_install "$out/local-path-provisioner-$LOCAL_PATH_VERSION" local-path-provisioner "" \
  "github.com/rancher/local-path-provisioner@$LOCAL_PATH_VERSION"
if [[ ! -x $out/pause/pause ]]; then
  log "building pause (e2e/kind/pause.c, static)"
  mkdir -p "$out/pause"
  cc -static -Os -s -o "$out/pause/pause" "$here/pause.c"
fi

# --- the base image: kind's images/base, on Debian packages ---------------------------------------
if ! docker image inspect "$PYTHON_BASE" >/dev/null 2>&1; then
  log "$PYTHON_BASE is missing: images/build.sh makes it (debootstrap)"
  bash "$repo/images/build.sh" >&2
fi
if [[ $(docker image inspect -f '{{index .Config.Labels "dev.retex.kind-node"}}' "$BASE_IMAGE" 2>/dev/null) != "$key-$recipe" ]]; then
  log "building $BASE_IMAGE (e2e/kind/Dockerfile.base: apt-get in the build, under a minute)"
  ctx=$out/base-context
  rm -rf "$ctx"; mkdir -p "$ctx/bin" "$ctx/cni"
  cp -r "$kind_src/images/base/files" "$ctx/kind-files"
  chmod -R u+w "$ctx/kind-files"
  find "$ctx/kind-files" -type d -exec chmod 0755 {} +
  find "$ctx/kind-files" -type f -exec chmod 0644 {} +
  chmod 0755 "$ctx"/kind-files/usr/local/bin/* "$ctx"/kind-files/kind/bin/*
  install -m 0755 "$here/node-cni.sh" "$ctx/kind-files/usr/local/bin/node-cni.sh"
  install -m 0644 "$here/node-cni.service" "$ctx/kind-files/etc/systemd/system/node-cni.service"
  install -m 0755 "$out"/containerd/* "$out"/crictl/* "$ctx/bin/"
  install -m 0755 "$out"/cni/* "$ctx/cni/"
  "$DOCKER" build --progress=plain -f "$here/Dockerfile.base" \
    --build-arg "BASE_IMAGE=$PYTHON_BASE" --label "dev.retex.kind-node=$key-$recipe" -t "$BASE_IMAGE" "$ctx" 2>&1 \
    | { grep --line-buffered -E '^#[0-9]+ (\[|DONE|CACHED|ERROR)|ERROR|error' || true; } >&2
  [[ ${PIPESTATUS[0]} == 0 ]] || { log "base image build failed"; exit 1; }
  rm -rf "$ctx"
fi

# --- component images: what kubeadm's static pods and kube-proxy run ------------------------------
pause_image=$(sed -n 's/^ *sandbox_image = "\(.*\)"/\1/p' "$kind_src/images/base/files/etc/containerd/config.toml")
# Image archives of this recipe only (kube-proxy's base is built here too).
images=$out/images-$recipe
find "$out" -maxdepth 1 -name 'images-*' ! -name "images-$recipe" -exec rm -rf {} +
mkdir -p "$images"
component_image() {  # component_image <name> <image> <binary> <from>
  local name=$1 image=$2 binary=$3 from=$4 tar=$images/$1.tar
  [[ -f $tar ]] && return 0
  log "image $image ($(basename "$binary") FROM $from)"
  local ctx
  ctx=$(mktemp -d); cp "$binary" "$ctx/"
  printf 'FROM %s\nCOPY %s /usr/local/bin/\nENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nENTRYPOINT ["/usr/local/bin/%s"]\n' \
    "$from" "$(basename "$binary")" "$(basename "$binary")" >"$ctx/Dockerfile"
  "$DOCKER" build -q -t "$image" "$ctx" >/dev/null
  rm -rf "$ctx"
  docker save -o "$tar.partial" "$image" && mv "$tar.partial" "$tar"
}
rig_k8s=$cache/bin/kubernetes-$k8s_version
for component in kube-apiserver kube-controller-manager kube-scheduler; do
  component_image "$component" "$(image_for "$component")" "$rig_k8s/$component" scratch
done
# kube-proxy needs iptables and conntrack: on the local Debian base, which the storage helper
# below is too, so the node's containerd stores that base's layer once.
IPTABLES_IMAGE=retex-kind-iptables:bookworm
if ! docker image inspect "$IPTABLES_IMAGE" >/dev/null 2>&1; then
  log "image $IPTABLES_IMAGE (iptables, nftables, conntrack on $PYTHON_BASE)"
  printf 'FROM %s\nRUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iptables nftables conntrack >/dev/null && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/*\n' \
    "$PYTHON_BASE" | "$DOCKER" build -q -t "$IPTABLES_IMAGE" - >/dev/null
fi
component_image kube-proxy "$(image_for kube-proxy)" "$out/kubernetes/kube-proxy" "$IPTABLES_IMAGE"
component_image etcd "$(image_for etcd)" "$cache/bin/etcd-$etcd_version/etcd" scratch
component_image pause "$pause_image" "$out/pause/pause" scratch
component_image coredns "$(image_for coredns)" "$out/coredns-$coredns_version/coredns" scratch
# kind's storage manifest (its nodeimage package), with the images it names built here: the
# provisioner, and as its helper (a shell for mkdir/rm in the volume) the local Debian base.
python3 - "$kind_src/pkg/build/nodeimage/const_storage.go" >"$out/default-storage.yaml" <<'EOF2'
import re, sys
source = open(sys.argv[1]).read()
consts = dict(re.findall(r'^const (\w+) = "([^"]*)"', source, re.M))
# The Go expression `raw` + name + `raw` + ...: raw strings and constants alternate.
parts = source.split("const defaultStorageManifest = `", 1)[1].split("`")
manifest = [parts[0]]
for joint, raw in zip(parts[1::2], parts[2::2]):
    name = re.fullmatch(r"\s*\+\s*(\w+)\s*\+\s*", joint)
    if not name:
        break
    manifest += [consts[name.group(1)], raw]
print("".join(manifest))
EOF2
storage_image() { sed -n "s/^ *image: \(.*$1.*\)/\1/p" "$out/default-storage.yaml" | head -1; }
component_image local-path-provisioner "$(storage_image local-path-provisioner)" \
  "$out/local-path-provisioner-$LOCAL_PATH_VERSION/local-path-provisioner" scratch
if [[ ! -f $images/local-path-helper.tar ]]; then
  docker tag "$PYTHON_BASE" "$(storage_image local-path-helper)"
  docker save -o "$images/local-path-helper.tar" "$(storage_image local-path-helper)"
fi

# --- the node image: kind's nodeimage steps ---------------------------------------------------------
log "assembling $NODE_IMAGE: binaries into $BASE_IMAGE, images into its containerd"
build=retex-kind-build-$$
docker rm -f "$build" >/dev/null 2>&1 || true
trap 'docker rm -f "$build" >/dev/null 2>&1 || true' EXIT
docker run -d --name "$build" --entrypoint sleep --security-opt seccomp=unconfined "$BASE_IMAGE" infinity >/dev/null
for binary in kubelet kubeadm kubectl; do
  docker cp "$out/kubernetes/$binary" "$build:/usr/bin/$binary"
done
docker exec "$build" bash -c "chown root:root /usr/bin/kube* && chmod 0755 /usr/bin/kube* \
  && echo $k8s_version > /kind/version && systemctl enable node-cni.service && mkdir -p /kind/manifests"
docker cp "$out/default-storage.yaml" "$build:/kind/manifests/default-storage.yaml"
docker exec "$build" bash -c 'nohup containerd >/dev/null 2>&1 & for i in $(seq 30); do ctr version >/dev/null 2>&1 && exit 0; sleep 1; done; exit 1'
for tar in "$images"/*.tar; do
  docker exec -i "$build" ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned \
    --all-platforms --no-unpack --digests - <"$tar" 2> >(grep -v 'support for cgroup v1 is deprecated' >&2) >/dev/null
done
docker exec "$build" ctr --namespace=k8s.io images list -q 2>/dev/null | grep -v -e '^sha256:' -e '@sha256:' >&2
# (sleep, the container's PID 1, reaps nothing: containerd stays a zombie once it has exited)
docker exec "$build" bash -c 'pkill -x containerd; while ps -C containerd -o stat= | grep -qv Z; do sleep 0.2; done'
docker commit --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' \
  --change "LABEL dev.retex.kind-node=$key-$recipe" "$build" "$NODE_IMAGE" >/dev/null
log "built $NODE_IMAGE ($(docker image inspect -f '{{.Size}}' "$NODE_IMAGE" | awk '{printf "%d MB", $1/1e6}'))"
echo "$NODE_IMAGE"
