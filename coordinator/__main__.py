"""`python -m coordinator` — run one coordinator replica.

Prints ``PHALANX_COORDINATOR_READY id=ID az=AZ address=HOST:PORT`` once the
gRPC server is serving; SIGTERM/SIGINT shut down cleanly (resigning
leadership so a standby takes over at once, not after a TTL).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from coordinator.config import ConfigError, CoordinatorConfig, timings_from_arg
from coordinator.server import Coordinator
from phalanx.usage import OneLineParser


def parse_args(argv: list[str] | None = None) -> CoordinatorConfig:
    p = OneLineParser(prog="python -m coordinator", description=__doc__)
    p.add_argument("--cluster", default="local")
    p.add_argument("--az", required=True)
    p.add_argument("--id", required=True, help="coordinator id, unique in the cluster")
    p.add_argument("--etcd", required=True, help="etcd endpoints, host:port[,host:port]")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--advertise", default="")
    p.add_argument("--timings", default=os.environ.get("PHALANX_TIMINGS", ""),
                   help="JSON object of timing overrides, or 'fast' (validated together at start-up)")
    p.add_argument("--log-level", default=os.environ.get("PHALANX_LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format=f"%(asctime)s {a.id} %(levelname)s %(name)s: %(message)s")
    timings = timings_from_arg(a.timings)
    return CoordinatorConfig(
        cluster=a.cluster, az=a.az, coordinator_id=a.id, etcd=tuple(e for e in a.etcd.split(",") if e),
        listen=a.listen, advertise=a.advertise, timings=timings,
    ).validate()


async def amain(config: CoordinatorConfig) -> int:
    coord = Coordinator(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, coord.stop)
    try:
        address = await coord.start()
    except OSError as exc:  # --listen names a host that does not resolve, or a port that is taken
        await coord.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"PHALANX_COORDINATOR_READY id={config.coordinator_id} az={config.az} address={address}", flush=True)
    try:
        await coord.run()
    finally:
        await coord.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(amain(config))


if __name__ == "__main__":
    sys.exit(main())
