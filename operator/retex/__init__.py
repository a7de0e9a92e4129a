"""retex: Recoverable Task EXecution on Kubernetes."""
