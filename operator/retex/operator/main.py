"""`retex-operator`: runs the kopf operator for Task resources."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import kopf

from retex.logs import JsonLines


def main() -> None:
    parser = argparse.ArgumentParser(description="retex operator")
    parser.add_argument("--liveness", default=os.environ.get("RETEX_LIVENESS", "http://0.0.0.0:8080/healthz"),
                        help="kopf's health endpoint (probes); empty to serve none")
    parser.add_argument("--namespace", action="append",
                        help="watch only these namespaces (repeatable; default: RETEX_NAMESPACES, "
                             "comma-separated, else all)")
    args = parser.parse_args()
    args.namespace = args.namespace or [ns for ns in os.environ.get("RETEX_NAMESPACES", "").split(",") if ns]
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    import retex.operator.handlers  # noqa: F401  (registers the handlers)

    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace or [],
            standalone=True,  # one active replica; HA by leader election is not built yet
            liveness_endpoint=args.liveness or None,
        )
    )


if __name__ == "__main__":
    main()
