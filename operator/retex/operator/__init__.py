"""The kopf operator: thin glue between Task objects, the ledger and retex.kube."""
