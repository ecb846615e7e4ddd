"""Several "nodes" on this machine: ``python -m autotune.agents --nodes N --nproc-per-node P
-- MODULE ARGS...`` starts N torchrun agents that meet through torchrun's c10d rendezvous on
127.0.0.1, as the agents of N real nodes meet on the first node's address, and behaves like
``srun --kill-on-bad-exit``: when one agent fails (a rank of its node ran out of memory or
crashed), the others are stopped at once, so the trial ends within seconds instead of waiting in
a collective for a rank that is gone. It exits with the first failing agent's code.

Only the standard library and torchrun: this is the local stand-in for what a cluster's
scheduler does (see ``autotune.launchers``), used to test multi-node trials on one machine and
to run them on a machine with several "nodes" worth of devices.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

#: seconds the other agents get to stop their ranks after SIGTERM before they are killed
STOP_GRACE_S = 5.0
POLL_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    python: str,
    nodes: int,
    nproc_per_node: int,
    endpoint: str,
    rdzv_id: str,
    module_args: list[str],
    is_host: bool | None = None,
) -> list[str]:
    """One node's torchrun agent: c10d rendezvous at ``endpoint``, no restarts (a failed rank
    is a measured result, not something to retry)."""
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        "--max-restarts=0",
    ]
    if is_host is not None:
        cmd.append(f"--rdzv-conf=is_host={int(is_host)}")
    return [*cmd, "-m", *module_args]


def _group_members() -> list[int]:
    """Other processes of this process group (the agents' ranks included), from /proc."""
    me, group = os.getpid(), os.getpgrp()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # field 5 of stat: the process group
            pids.append(int(entry))
    return pids


def _stop(agents: list[subprocess.Popen[bytes]]) -> None:
    for proc in agents:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()  # torchrun stops its ranks on SIGTERM
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in agents):
        time.sleep(POLL_S)
    for proc in agents:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    if os.getsid(0) == os.getpgrp():  # our own group (the runner's job): ranks left behind
        for pid in _group_members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run_agents(nodes: int, nproc_per_node: int, module_args: list[str]) -> int:
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = uuid.uuid4().hex[:12]
    agents = [
        subprocess.Popen(
            torchrun(
                sys.executable,
                nodes,
                nproc_per_node,
                endpoint,
                rdzv_id,
                module_args,
                is_host=(i == 0),  # the first "node" hosts the rendezvous store
            ),
            stdin=subprocess.DEVNULL,
        )
        for i in range(nodes)
    ]
    try:
        while True:
            codes = [p.poll() for p in agents]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(agents)
                return int(failed[0]) if failed[0] > 0 else 128 - int(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_S)
    except BaseException:
        _stop(agents)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.agents", description=__doc__)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("module_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    module_args = args.module_args[1:] if args.module_args[:1] == ["--"] else args.module_args
    if args.nodes < 1 or args.nproc_per_node < 1 or not module_args:
        parser.error("--nodes and --nproc-per-node must be >= 1, and a module must follow --")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run_agents(args.nodes, args.nproc_per_node, module_args)


if __name__ == "__main__":
    sys.exit(main())
