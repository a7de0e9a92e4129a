#!/usr/bin/env bash
# Makes the ledger endpoint's serving certificate and puts it in the Secret the operator mounts:
#   manifests/ledger-tls.sh [NAMESPACE]        (default retex-system; kubectl's current context)
# A CA of its own (kept only inside the Secret as ca.crt, its key thrown away) signs a certificate
# for retex-ledger.NAMESPACE.svc. With cert-manager, issue a Certificate into the same Secret name
# instead (docs/install.md). Running it again makes a new CA: Jobs created after the kubelet updates
# the operator's files carry it; workers started before fail over to a new attempt.
set -euo pipefail
ns="${1:-retex-system}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
echo "==> a CA and a serving certificate for retex-ledger.$ns.svc (EC P-256, 825 days)"
openssl ecparam -name prime256v1 -genkey -noout -out ca.key
openssl req -x509 -new -key ca.key -subj "/CN=retex-ledger-ca" -days 825 \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign -out ca.crt
openssl ecparam -name prime256v1 -genkey -noout -out tls.key
openssl req -new -key tls.key -subj "/CN=retex-ledger" -out tls.csr
printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
  "extendedKeyUsage=serverAuth" \
  "subjectAltName=DNS:retex-ledger.$ns.svc,DNS:retex-ledger.$ns.svc.cluster.local,DNS:retex-ledger.$ns" > ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 16)" \
  -days 825 -extfile ext -out tls.crt
echo "==> Secret $ns/retex-ledger-tls"
kubectl create secret generic retex-ledger-tls -n "$ns" --from-file=tls.crt --from-file=tls.key \
  --from-file=ca.crt --dry-run=client -o yaml | kubectl apply -f -
