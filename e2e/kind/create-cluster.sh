#!/usr/bin/env bash
# A kind cluster on this machine: `e2e/kind/create-cluster.sh <name> <kubeconfig> [config]`
# (config default e2e/kind/cluster.yaml). The node image comes from e2e/kind/build-node.sh (kind's
# own where it can be pulled, else the locally built one), and the cluster configuration gets the
# patches such hosts need, each only where it is needed (docs/contributing/development.md, "A kind
# cluster where kindest/node cannot be pulled"):
#   - cgroup v1 host: kubelet >= 1.35 refuses cgroup v1 unless `failCgroupV1: false`;
#   - no CAP_SYS_RESOURCE in the capability bounding set: containerd must not lower
#     oom_score_adj (`restrict_oom_score_adj`, else every sandbox fails with "can't get final
#     child's PID from pipe: EOF"), and privileged pods need images/runc-capbnd as containerd's
#     runc: mounted into every node (`extraMounts`), since no node image has it, kind's own
#     included;
#   - the locally built image has no kindnetd: kind's default CNI is off and the image's
#     node-cni service (e2e/kind/node-cni.sh) provides the pod network.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
name=${1:?cluster name}
kubeconfig=${2:?kubeconfig path}
config=${3:-$here/cluster.yaml}
log() { echo "[kind-cluster $(date +%H:%M:%S)] $*" >&2; }

image=$(bash "$here/build-node.sh")
kind=$(bash "$here/kind-path.sh")  # build-node.sh built it

patched=$(mktemp /tmp/retex-kind-config.XXXXXX.yaml)
trap 'rm -f "$patched"' EXIT
cp "$config" "$patched"
kubelet_patches=() containerd_patches=()
if [[ ! -f /sys/fs/cgroup/cgroup.controllers ]]; then
  log "cgroup v1 host: kubelet failCgroupV1: false"
  kubelet_patches+=("failCgroupV1: false")
fi
bounding=$((16#$(awk '/^CapBnd:/ {print $2}' /proc/self/status)))
if (( bounding != (1 << ($(cat /proc/sys/kernel/cap_last_cap) + 1)) - 1 )); then
  log "capability bounding set $(printf '%x' "$bounding") is reduced: containerd restrict_oom_score_adj, runc-capbnd mounted"
  containerd_patches+=('[plugins."io.containerd.grpc.v1.cri"]'
    '  restrict_oom_score_adj = true'
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]'
    '  BinaryName = "/usr/local/sbin/runc-capbnd"')
  # A copy of its own, not the checkout's file: a kept cluster's node that restarts must find it
  # whatever the checkout has become since.
  wrapper=${RETEX_CACHE:-$HOME/.cache/retex}/kind/runc-capbnd
  install -D -m 0755 "$repo/images/runc-capbnd" "$wrapper"
  if grep -qE '^[^#]*extraMounts:' "$config"; then
    log "$config has extraMounts of its own: add $wrapper at /usr/local/sbin/runc-capbnd to each node's yourself"
    exit 1
  fi
  # After each `- role:` line, at its keys' indentation.
  awk -v wrapper="$wrapper" '
    { print }
    match($0, /^ *- role:/) {
      pad = sprintf("%" (RLENGTH - length("- role:") + 2) "s", "")
      print pad "extraMounts:"
      print pad "  - hostPath: " wrapper
      print pad "    containerPath: /usr/local/sbin/runc-capbnd"
      print pad "    readOnly: true"
    }' "$config" >"$patched"
  nodes=$(grep -cE '^[^#]*role:' "$config" || true)
  mounted=$(grep -c 'containerPath: /usr/local/sbin/runc-capbnd' "$patched" || true)
  if ((nodes == 0 || mounted != nodes)); then
    log "$config: runc-capbnd could be mounted into $mounted of $nodes nodes; list every node as \`  - role: <role>\` (its first key)"
    exit 1
  fi
fi
local_image=false
[[ $image == retex-kind-node:* ]] && local_image=true
{
  if $local_image; then
    log "locally built node image $image: kind's default CNI off, the image's node-cni on"
    printf 'networking:\n  disableDefaultCNI: true\n'
  fi
  if ((${#kubelet_patches[@]})); then
    printf 'kubeadmConfigPatches:\n  - |\n    kind: KubeletConfiguration\n'
    printf '    %s\n' "${kubelet_patches[@]}"
  fi
  if ((${#containerd_patches[@]})); then
    printf 'containerdConfigPatches:\n  - |-\n'
    printf '    %s\n' "${containerd_patches[@]}"
  fi
} >>"$patched"

log "kind create cluster --name $name --image $image"
"$kind" create cluster --name "$name" --image "$image" --config "$patched" --kubeconfig "$kubeconfig" \
  --wait "${RETEX_KIND_WAIT:-300s}"
# kind's --wait covers the control plane only; workers join a few seconds later.
log "waiting until every node is Ready"
docker exec "$name-control-plane" kubectl --kubeconfig /etc/kubernetes/admin.conf wait --for=condition=Ready \
  nodes --all --timeout="${RETEX_KIND_WAIT:-300s}" >&2
