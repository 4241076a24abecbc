"""A trainer process for the exactly-once tests: drives `--rollouts` trajectories of `--steps`
steps each through the SDK, writing every answer it got to `--out` (JSON lines), and can be
SIGKILLed and started again at any point: it replays each rollout from step 0."""

from __future__ import annotations

import argparse
import json
import os
import sys

from sandfleet import Client, SandboxError, SandboxSpec

# Each step appends its name to a log in the sandbox (the counter that proves it ran once),
# lingers (so a kill lands mid-step), and answers with how many steps had run.
STEP = "echo step-{i} >> /ran.log; sleep {pause}; echo {i}:$SANDFLEET_SEED:$(wc -l < /ran.log)"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pause", type=float, default=0.3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with Client(a.socket, timeout=30) as fleet, open(a.out, "a") as out:
        for r in range(a.rollouts):
            rid = f"{a.prefix}-{r}"
            spec = SandboxSpec(image="busybox", idle_ttl=600, labels={"job": a.prefix})
            traj = fleet.trajectory(rid, spec, seed=1000 + r, labels={"job": a.prefix})
            for i in range(a.steps):
                try:
                    res = traj.exec(STEP.format(i=i, pause=a.pause), timeout=30)
                    rec = {"rollout": rid, "step": i, "stdout": res.stdout, "replayed": traj.last.replayed}
                except SandboxError as exc:
                    rec = {"rollout": rid, "step": i, "error": exc.code, "cause": exc.cause}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                os.fsync(out.fileno())
            traj.close(stop_sandbox=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
