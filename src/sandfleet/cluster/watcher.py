"""A gateway's eyes on Ray, as a child process: `python -m sandfleet.cluster.watcher ...`.

Prints one JSON line per poll: the nodes Ray knows with their liveness, and the live gateways.
It is a process of its own because a Ray driver exits when it loses Ray's head for long enough
(and holds threads and memory the gateway's event loop need not share): when it dies, the gateway
keeps the last membership it printed, keeps serving, and starts another watcher a moment later.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import sys
import time


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--namespace", default="sandfleet")
    p.add_argument("--gateway-id", required=True)
    p.add_argument("--gateway-url", required=True)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--lost-after", type=float, default=60.0)
    args = p.parse_args()
    _die_with_parent()
    from sandfleet.cluster import registry  # Ray is imported here, in this process only

    registry.connect(args.address, args.namespace)
    watcher = registry.Watcher(args.namespace, lost_after=args.lost_after)
    while True:
        t0 = time.monotonic()
        watcher.beat(args.gateway_id, args.gateway_url)
        nodes = watcher.nodes()
        line = {
            "nodes": [
                {"key": n.key, "url": n.url, "group": n.group, "alive": n.alive, "generation": n.generation}
                for n in nodes
            ],
            "gateways": watcher.gateways(),
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))


if __name__ == "__main__":
    main()
