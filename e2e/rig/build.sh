#!/usr/bin/env bash
# Builds the control-plane binaries the local rig runs (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler) and the helm CLI the chart tests run,
# from their Go modules, static and version-stamped, into a cache outside the
# repository keyed by version:
#   $RETEX_CACHE/bin/kubernetes-v<K>/, $RETEX_CACHE/bin/etcd-v<E>/, $RETEX_CACHE/bin/helm-v<H>/
# A warm cache returns at once; a cold build prints progress as packages compile.
# Arguments pick what to build (etcd kubernetes helm); none: all three.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${RETEX_CACHE:-$HOME/.cache/retex}
k8s_version=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$here/gobuild/kubernetes/go.mod")
etcd_version=$(awk '$1=="require" && $2=="go.etcd.io/etcd/server/v3" {print $3}' "$here/gobuild/etcd/go.mod")
k8s_out=$cache/bin/kubernetes-$k8s_version
etcd_out=$cache/bin/etcd-$etcd_version
helm_version=$(awk '$1=="require" && $2=="helm.sh/helm/v4" {print $3}' "$here/gobuild/helm/go.mod")
helm_out=$cache/bin/helm-$helm_version

export CGO_ENABLED=0 GOFLAGS=-mod=mod

# One build at a time per cache: two at once (make test-fast's helm beside make rig-binaries')
# share each <name>.partial directory and each wipes the other's.
mkdir -p "$cache/bin"
exec 9>"$cache/bin/.build.lock"
flock -n 9 || { echo "another build into $cache/bin is running: waiting for it"; flock 9; }

progress() {  # turns `go build -v` package lines into a periodic count
  local what=$1 start=$SECONDS n=0
  while IFS= read -r line; do
    case $line in
      \#*|go:*|*.go:[0-9]*) echo "$line" ;;  # compiler and go-command messages
      *) n=$((n + 1)); if (( n % 100 == 0 )); then echo "  [$what] $n packages compiled, $((SECONDS - start))s"; fi ;;
    esac
  done
  echo "  [$what] done: $n packages, $((SECONDS - start))s"
}

build_kubernetes() {
  local tmp=$k8s_out.partial
  [[ -x $k8s_out/kube-apiserver && -x $k8s_out/kube-controller-manager && -x $k8s_out/kube-scheduler ]] && return 0
  echo "building Kubernetes $k8s_version control plane (cold build: ~15-30 min on 2 cores)..."
  rm -rf "$tmp"; mkdir -p "$tmp"
  local minor=${k8s_version#v1.}; minor=${minor%%.*}
  local pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"
  (cd "$here/gobuild/kubernetes" && go build -v -trimpath -ldflags "$ldflags" -o "$tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler) 2>&1 | progress kubernetes
  [[ ${PIPESTATUS[0]} == 0 ]] || { echo "kubernetes build failed" >&2; return 1; }
  rm -rf "$k8s_out"; mv "$tmp" "$k8s_out"
}

build_etcd() {
  local tmp=$etcd_out.partial
  [[ -x $etcd_out/etcd ]] && return 0
  echo "building etcd $etcd_version..."
  rm -rf "$tmp"; mkdir -p "$tmp"
  (cd "$here/gobuild/etcd" && go build -v -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3) 2>&1 | progress etcd
  [[ ${PIPESTATUS[0]} == 0 ]] || { echo "etcd build failed" >&2; return 1; }
  rm -rf "$etcd_out"; mv "$tmp" "$etcd_out"
}

build_helm() {
  local tmp=$helm_out.partial
  [[ -x $helm_out/helm ]] && return 0
  echo "building helm $helm_version (cold build: a few minutes on 2 cores)..."
  rm -rf "$tmp"; mkdir -p "$tmp"
  local pkg=helm.sh/helm/v4/internal/version
  (cd "$here/gobuild/helm" && go build -v -trimpath \
      -ldflags "-s -w -X $pkg.version=$helm_version -X $pkg.gitTreeState=clean" \
      -o "$tmp/helm" helm.sh/helm/v4/cmd/helm) 2>&1 | progress helm
  [[ ${PIPESTATUS[0]} == 0 ]] || { echo "helm build failed" >&2; return 1; }
  rm -rf "$helm_out"; mv "$tmp" "$helm_out"
}

targets=("$@"); (( ${#targets[@]} )) || targets=(etcd kubernetes helm)
for one in "${targets[@]}"; do
  case $one in
    etcd) build_etcd; echo "etcd: $etcd_out" ;;
    kubernetes) build_kubernetes; echo "kubernetes: $k8s_out" ;;
    helm) build_helm; echo "helm: $helm_out/helm" ;;
    *) echo "unknown binary: $one (etcd, kubernetes or helm)" >&2; exit 2 ;;
  esac
done
