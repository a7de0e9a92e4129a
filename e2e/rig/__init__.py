"""The local Kubernetes rig: real etcd, kube-apiserver, kube-controller-manager and kube-scheduler
built from their Go modules, plus process-based test node agents. Test infrastructure only."""
