#!/bin/bash
# The pod network of the locally built kind node image, in place of kindnetd (which no module
# proxy serves): a systemd service on every node that, once kubelet has joined, writes a ptp
# CNI configuration for the node's podCIDR and keeps a route to each other node's podCIDR via
# that node's InternalIP (the nodes share one docker network). What kindnetd does, minus network
# policies (traffic leaving a node's podCIDR is masqueraded, pod to pod across nodes included).
set -u
KUBECONFIG=/etc/kubernetes/kubelet.conf
export KUBECONFIG
node=$(hostname)
conf=/etc/cni/net.d/10-retex-ptp.conflist
# Kubelet's credentials may read only their own Node (the Node authorizer); RBAC lets every node
# list them all, granted once from a control-plane node.
grant_node_list() {
  kubectl --kubeconfig /etc/kubernetes/admin.conf apply -f - >/dev/null <<'YAML'
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: retex-node-cni}
rules: [{apiGroups: [""], resources: [nodes], verbs: [get, list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: retex-node-cni}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: retex-node-cni}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}]
YAML
}
granted=false
while true; do
  if ! $granted && [[ -f /etc/kubernetes/admin.conf ]] && grant_node_list; then granted=true; fi
  if [[ -f $KUBECONFIG ]]; then
    rows=$(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' 2>/dev/null)
    while read -r name cidr ip; do
      [[ -n $cidr && -n $ip ]] || continue
      if [[ $name == "$node" ]]; then
        if [[ ! -f $conf ]] || ! grep -q "\"$cidr\"" "$conf"; then
          mkdir -p /etc/cni/net.d
          cat >"$conf.tmp" <<CONF
{
  "cniVersion": "1.0.0",
  "name": "retex-ptp",
  "plugins": [
    {"type": "ptp", "ipMasq": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$cidr"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
CONF
          mv "$conf.tmp" "$conf"
          echo "pod network: $cidr on $node"
        fi
      else
        ip route replace "$cidr" via "$ip" 2>/dev/null
      fi
    done <<<"$rows"
  fi
  sleep 5
done
