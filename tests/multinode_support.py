"""A real multi-node Ray cluster on this one machine, for tests.

Every node is its own ``ray start --block`` process (a head, then ``ray start --address``
nodes), with its own role resources, a loopback IP of its own and OS-chosen ports for every
component, so two nodes never clash with each other or with another Ray on this machine.
A node's processes (raylet, agents, the workers it spawned) all descend from its ``ray start``
process, which is how a node is killed whole or stopped, and nothing else is touched: no
``ray stop`` (it stops every Ray on the machine).

Loopback IPs: Ray 2.60's ``ray start`` turns ``--node-ip-address=127.0.0.1`` (and an
``--address`` on 127.0.0.1) into the host's routable IP unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
and with that setting it refuses to start non-head nodes. Ray only rewrites the exact strings
``127.0.0.1`` / ``localhost`` / ``::1``, so nodes here take 127.0.0.2, 127.0.0.3, ... (all on
``lo``; each node gets a distinct IP, like real nodes). Every process started here carries a tag in
its environment, so that ``shutdown`` also finds what outlived its node (an orphaned worker).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil

from kvfleet_testing.ports import free_port

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
TAG_VARIABLE = "KVFLEET_TEST_RAY_NODE_TAG"
OBJECT_STORE_BYTES = 128 * 2**20
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
STARTED_MARKER = "Ray runtime started"
# The GCS declares a node dead after ``failure_threshold`` failed health checks in a row (Ray's
# defaults: every 3 s, 10 s timeout); a killed node's actors are reported dead only then. A dead
# raylet refuses the check at once, so checking every second finds it in about 5 s; the timeout
# stays long so that a live node on a loaded machine is never declared dead.
HEALTH_CHECK_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "5000",
    "RAY_health_check_failure_threshold": "5",
}


def _ray_executable() -> str:
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise RuntimeError("the `ray` command is not installed beside this Python")
    return found


@dataclass
class RayNode:
    """One node: its ``ray start --block`` process, its IP and role resources."""

    name: str
    ip: str
    resources: dict[str, float]
    process: subprocess.Popen[bytes]
    log_path: Path
    killed_pids: list[int] = field(default_factory=list)

    def processes(self) -> list[psutil.Process]:
        """The node's live processes: ``ray start`` and everything below it (raylet, agents, workers)."""
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def pids(self) -> set[int]:
        return {p.pid for p in self.processes()}

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> list[int]:
        """Lose the node at once: freeze its whole process tree, then SIGKILL every process in it
        (no process of it gets to notice the others going). Returns the pids killed."""
        procs = self.processes()
        for proc in procs:
            _signal(proc, signal.SIGSTOP)
        for proc in procs:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(procs, timeout=STOP_TIMEOUT_S)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        self.killed_pids = [p.pid for p in procs]
        log.info("killed node %s (%s): pids %s", self.name, self.ip, self.killed_pids)
        return self.killed_pids

    def stop(self) -> None:
        """Stop the node gracefully (SIGTERM to ``ray start``, which stops its processes); kill
        whatever is left after ``STOP_TIMEOUT_S``."""
        procs = self.processes()
        if not procs:
            return
        _signal(procs[0], signal.SIGTERM)
        _, left = psutil.wait_procs(procs, timeout=STOP_TIMEOUT_S)
        for proc in left:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(left, timeout=STOP_TIMEOUT_S)
        if self.process.poll() is None:
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


class LocalMultiNodeRay:
    """A head node plus further nodes on this machine; ``address`` is what a driver connects to.

    Use as a context manager (or call ``shutdown``): every process it started is gone after it,
    also when a start failed half way.
    """

    def __init__(self, num_cpus_per_node: int = 2, base_ip: str = "127.0.0.2"):
        self.num_cpus_per_node = num_cpus_per_node
        self._ip_prefix, last = base_ip.rsplit(".", 1)
        self._next_ip = int(last)
        self.tag = uuid.uuid4().hex
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kvfleet-mn-"))
        self.nodes: dict[str, RayNode] = {}
        self.address = ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def head(self) -> RayNode:
        return next(iter(self.nodes.values()))

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(HEALTH_CHECK_ENV)
        env.update(
            {
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # else `ray start --address` refuses
                "UCX_NET_DEVICES": "lo",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
                TAG_VARIABLE: self.tag,
            }
        )
        # The driver's token mode, else none: with RAY_AUTH_MODE unset, `ray start --head` turns
        # token auth on when ~/.ray/auth_token exists (any local ray.init on this machine writes
        # one) but `ray start --address` and a driver given an address do not, and cannot join.
        env.setdefault("RAY_AUTH_MODE", "disabled")
        return env

    def add_node(self, name: str, resources: dict[str, float]) -> RayNode:
        """Start a node (the first one is the head) and wait until it runs."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} exists already")
        ip = f"{self._ip_prefix}.{self._next_ip}"
        self._next_ip += 1
        head = not self.nodes
        args = [
            _ray_executable(),
            "start",
            "--block",
            f"--node-ip-address={ip}",
            f"--num-cpus={self.num_cpus_per_node}",
            f"--resources={json.dumps(resources)}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
            "--include-log-monitor=false",
            # 0: the OS picks each port when it binds, so no two nodes (or Rays) can clash
            "--node-manager-port=0",
            "--object-manager-port=0",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--dashboard-agent-listen-port={free_port(ip)}",  # Ray's default is one fixed port
        ]
        if head:
            port = free_port(ip)
            self.address = f"{ip}:{port}"
            args += [
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port(ip)}",
                f"--ray-client-server-port={free_port(ip)}",
                f"--temp-dir={self.temp_dir}",
            ]
        else:
            args.append(f"--address={self.address}")
        log_path = self.temp_dir / f"{name}.log"
        with log_path.open("wb") as out:
            process = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        node = RayNode(name, ip, dict(resources), process, log_path)
        self.nodes[name] = node
        self._wait_started(node)
        log.info("node %s up at %s with %s (pid %d)", name, ip, resources, process.pid)
        return node

    def _wait_started(self, node: RayNode) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while STARTED_MARKER not in node.log_path.read_text(errors="replace"):
            if not node.alive():
                code = node.process.returncode
                raise RuntimeError(f"node {node.name}: `ray start` exited {code}:\n{node.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node.name}: not started after {START_TIMEOUT_S:.0f} s:\n{node.log_tail()}")
            time.sleep(0.2)

    def tagged_processes(self) -> list[psutil.Process]:
        """Every live process on this machine that carries this cluster's tag."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(TAG_VARIABLE) == self.tag:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def shutdown(self) -> None:
        """Stop every node (workers first, the head last), then kill any tagged leftover."""
        for node in reversed(list(self.nodes.values())):
            try:
                node.stop()
            except Exception as exc:  # noqa: BLE001  (keep going: the other nodes must stop too)
                log.warning("stopping node %s: %s", node.name, exc)
        left = self.tagged_processes()
        for proc in left:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(left, timeout=STOP_TIMEOUT_S)
        if left:
            log.warning("killed %d leftover processes of the test Ray cluster", len(left))
        shutil.rmtree(self.temp_dir, ignore_errors=True)
