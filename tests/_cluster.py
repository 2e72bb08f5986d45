"""A loopback Ray cluster of "machines" that share no directory (a test harness).

Every machine is a ``ray start --block`` raylet (with its workers) in a mount namespace of its
own (``unshare -m --propagation private``) where private tmpfs are mounted over ``/tmp``,
``/dev/shm`` and a home directory, and the working directory is inside that ``/tmp``. What one
machine writes there, no other machine and not the driver can see; killing every process of the
namespace is the machine's loss, and its disk goes with it (the tmpfs vanishes with the last
process). The code (the venv, the source tree) is the one directory all see, read-only in
spirit, like the identical image of a real cluster's machines.

The head raylet (GCS, no CPUs, no epochal resources) runs in a namespace of its own too, without
private mounts: it is the driver's machine, so the driver (the test process, in the host
namespace) reaches its sockets. All traffic is on 127.0.0.1: every machine gets its own free
ports; only an S3-compatible server on 127.0.0.1 (see the ``s3`` fixture) is shared storage.

Needs root (mount namespaces), ``unshare`` from util-linux and Ray. Everything the harness
starts, it stops (``shutdown``; also when a start fails), bounded in time.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
RAY = Path(sys.executable).with_name("ray")
MIB = 1 << 20

# Faster node-death detection by the GCS for machines that stop answering than Ray's defaults
# (a frozen machine was found dead after ~65 s here with them): a check every 1 s, 2 s timeout,
# dead after 8 failures in a row (~10 s). A CI run with 4 checks of 0.5 s lost a healthy raylet
# on a loaded 2-core machine, so this leaves a live one 8-10 s to answer.
GCS_ENV = {
    "RAY_health_check_initial_delay_ms": "2000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "8",
}

# What a machine mounts before it starts its raylet: its own /tmp, /dev/shm (the object
# store's mmap files) and home, and a working directory inside its /tmp.
# The code (this checkout, its venv, the Python install) stays visible at its own path even
# when it lives under /tmp (a CI clone there, say): it is bind-mounted aside first and back
# into the new /tmp after (mounts in this namespace only; the host sees none of them).
_MACHINE_SH = """set -e
{keep}
mount -t tmpfs -o size={tmp_mib}m,mode=1777 epochal-tmp /tmp
mount -t tmpfs -o size={shm_mib}m epochal-shm /dev/shm
{restore}
mkdir -p /tmp/home /tmp/work
cd /tmp/work
exec "$@"
"""


def _code_under_tmp() -> list[str]:
    """The code paths a machine needs that a private /tmp would hide (outermost first)."""
    paths = sorted({str(p) for p in (TESTS.parent, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve())
                    if str(p) == "/tmp" or str(p).startswith("/tmp/")})
    out: list[str] = []
    for p in paths:  # a path inside one already kept comes along with it
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def _keep_scripts() -> tuple[str, str]:
    keep, restore = [], []
    for i, path in enumerate(_code_under_tmp()):
        aside = f"/run/epochal-keep-{os.getpid()}-{i}"
        keep.append(f"mkdir -p {aside} && mount --bind {shlex.quote(path)} {aside}")
        restore.append(f"mkdir -p {shlex.quote(path)} && mount --bind {aside} {shlex.quote(path)}")
    return "\n".join(keep), "\n".join(restore)


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port on 127.0.0.1, never one this process handed out before: the kernel may give
    a just-closed port again, and Ray refuses two components on one port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def mount_ns(pid: int) -> str | None:
    """The mount namespace of process ``pid`` (``mnt:[inode]``), None when it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def pids_in_namespace(ns: str) -> list[int]:
    """Every live process whose mount namespace is ``ns``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and mount_ns(int(entry)) == ns:
            out.append(int(entry))
    return out


@dataclass
class Machine:
    """One machine: its ``ray start --block`` process (first process of its namespace)."""

    name: str
    resources: dict[str, float]
    proc: subprocess.Popen[bytes]
    ns: str
    node_manager_port: int
    log: Path
    node_id: str = ""  # its Ray node id, once registered
    dead: bool = field(default=False)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class ClusterError(RuntimeError):
    """The harness could not start or stop a machine (its log tail is in the message)."""


class LoopbackCluster:
    """A head and any number of machines on 127.0.0.1; see the module docstring.

    ``object_store_mib`` per raylet (Ray's minimum is 75 MiB), ``tmp_mib`` the size of each
    machine's private /tmp. Use as a context manager, or call ``shutdown`` in a finally."""

    def __init__(self, *, object_store_mib: int = 80, tmp_mib: int = 512, num_cpus: int = 1,
                 gcs_env: dict[str, str] | None = None) -> None:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            raise ClusterError("the loopback cluster needs root and unshare (mount namespaces)")
        self.gcs_env = GCS_ENV if gcs_env is None else gcs_env  # {}: Ray's own health checks
        self.object_store_mib = object_store_mib
        self.tmp_mib = tmp_mib
        self.num_cpus = num_cpus
        # short: Ray's Unix socket paths under the head's temp dir must stay < 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="ecl-", dir="/tmp"))
        self.head: Machine | None = None
        self.machines: dict[str, Machine] = {}
        self.gcs_port = 0
        self._count = 0
        self._connected = False  # whether start() connected the driver
        self.restarts = 0  # machines started again after their `ray start` gave up
        atexit.register(self.shutdown)  # also when the test process ends without finalizers

    # -- environment and processes
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(self.gcs_env)
        env.update(
            PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]),
            RAY_USAGE_STATS_ENABLED="0",
            # Ray >= 2.5x turns token authentication on for `ray start --head`; the loopback
            # cluster is reachable only from this host, and the driver would need the token
            RAY_AUTH_MODE="disabled",
            PYTHONDONTWRITEBYTECODE="1",
        )
        return env

    def _ports(self) -> list[str]:
        """Ports of one raylet: every one its own, so several raylets share 127.0.0.1."""
        return [
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
        ]

    def _spawn(self, name: str, resources: dict[str, float], private: bool, args: list[str]) -> Machine:
        self._count += 1
        log = self.root / f"{self._count:02d}-{name}.log"
        ports = self._ports()
        # the head: Ray's own CLI; a worker machine: the same CLI through _ray_start.py
        launcher = [sys.executable, str(TESTS / "_ray_start.py")] if private else [str(RAY)]
        argv = [
            *launcher, "start", "--block", "--node-ip-address=127.0.0.1",
            f"--num-cpus={0 if not private else self.num_cpus}",
            f"--object-store-memory={self.object_store_mib * MIB}",
            f"--resources={json.dumps(resources)}",
            "--include-log-monitor=false", "--disable-usage-stats",
            "--min-worker-port=0", "--max-worker-port=0",
            *ports, *args,
        ]
        env = self._env()
        if not private:
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback addresses stay loopback
        if private:
            env.update(HOME="/tmp/home", TMPDIR="/tmp")
            keep, restore = _keep_scripts()
            script = _MACHINE_SH.format(tmp_mib=self.tmp_mib, shm_mib=self.object_store_mib + 64,
                                        keep=keep, restore=restore)
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "machine", *argv]
        else:
            cmd = ["unshare", "-m", "--propagation", "private", *argv]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd="/" if private else str(self.root))
        # unshare then exec: the pid is the first process of the new namespace
        deadline = time.monotonic() + 10
        ns = mount_ns(proc.pid)
        while (ns is None or ns == mount_ns(os.getpid())) and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
            ns = mount_ns(proc.pid)
        nm_port = int(ports[0].split("=")[1])
        machine = Machine(name, dict(resources), proc, ns or "", nm_port, log)
        if not ns or ns == mount_ns(os.getpid()):
            self._kill(machine)
            raise ClusterError(f"{name}: no mount namespace of its own\n{machine.log_tail()}")
        return machine

    # -- the cluster
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def start(self, specs: dict[str, dict[str, float]], timeout: float = 90.0) -> list[Machine]:
        """Start the head and one machine per ``name -> resources`` at once (the machines'
        raylets wait for the GCS), connect the driver (``ray.init``), and wait until every
        machine is an alive node of the cluster."""
        import ray

        self._spawn_head()
        started = [self._spawn_machine(name, resources) for name, resources in specs.items()]
        self._wait_head(timeout)
        ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
        self._connected = True
        self._wait_registered(started, timeout)
        return [self.machines[name] for name in specs]  # restarted ones are new objects

    def _spawn_head(self) -> None:
        self.gcs_port = free_port()
        self.head = self._spawn("head", {}, False, [
            "--head", f"--port={self.gcs_port}", f"--temp-dir={self.root / 'h'}",
            "--include-dashboard=false", f"--dashboard-port={free_port()}",
        ])

    def _wait_head(self, timeout: float) -> None:
        """Wait until the head's raylet is up (its socket, in the head's temp dir, which the
        driver sees)."""
        assert self.head is not None
        raylet = self.root / "h" / "session_latest" / "sockets" / "raylet"
        deadline = time.monotonic() + timeout
        while not raylet.exists():
            if self.head.proc.poll() is not None:
                raise ClusterError(f"the head exited ({self.head.proc.returncode})\n{self.head.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"the head's raylet was not up in {timeout} s\n{self.head.log_tail()}")
            time.sleep(0.05)

    def _spawn_machine(self, name: str, resources: dict[str, float]) -> Machine:
        if name in self.machines and not self.machines[name].dead:
            raise ClusterError(f"machine {name} is already running")
        m = self._spawn(name, resources, True, [f"--address={self.address}", "--temp-dir=/tmp/ray"])
        self.machines[name] = m
        return m

    def add_machines(self, specs: dict[str, dict[str, float]], timeout: float = 90.0) -> list[Machine]:
        """Start one machine per ``name -> resources`` (in parallel) on the running cluster and
        wait until each is an alive node."""
        started = [self._spawn_machine(name, resources) for name, resources in specs.items()]
        self._wait_registered(started, timeout)
        return [self.machines[name] for name in specs]  # restarted ones are new objects

    def add_machine(self, name: str, resources: dict[str, float], timeout: float = 90.0) -> Machine:
        return self.add_machines({name: resources}, timeout)[0]

    def _wait_registered(self, machines: list[Machine], timeout: float, retries: int = 1) -> None:
        """Wait until every machine is an alive node. A machine whose ``ray start`` gives up
        (its raylet must register within 30 s, which a loaded 2-core host can miss) is
        started again, ``retries`` times."""
        import ray

        deadline = time.monotonic() + timeout
        waiting = list(machines)
        tries = {m.name: 0 for m in machines}
        while waiting:
            for m in list(waiting):
                if m.proc.poll() is None:
                    continue
                why = f"machine {m.name} exited ({m.proc.returncode})\n{m.log_tail()}\n{self._raylet_log(m)}"
                self._kill(m)
                if tries[m.name] >= retries:
                    raise ClusterError(why)
                tries[m.name] += 1
                self.restarts += 1
                waiting.remove(m)
                self.machines.pop(m.name)
                waiting.append(self._spawn_machine(m.name, m.resources))
            alive = {n["NodeManagerPort"]: n for n in ray.nodes() if n["Alive"]}
            for m in list(waiting):
                if m.node_manager_port in alive:
                    m.node_id = alive[m.node_manager_port]["NodeID"]
                    waiting.remove(m)
            if waiting and time.monotonic() > deadline:
                raise ClusterError(
                    f"machines {[m.name for m in waiting]} did not join in {timeout} s\n"
                    + "\n".join(m.log_tail() + self._raylet_log(m) for m in waiting))
            if waiting:
                time.sleep(0.1)

    def _raylet_log(self, m: Machine, n: int = 15) -> str:
        """The tail of ``m``'s raylet log, read through a live process of its namespace."""
        for pid in pids_in_namespace(m.ns) if m.ns else []:
            path = Path(f"/proc/{pid}/root/tmp/ray/session_latest/logs/raylet.out")
            try:
                return "raylet.out:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-n:])
            except OSError:
                continue
        return ""

    def node_alive(self, node_id: str) -> bool:
        import ray

        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def wait_dead(self, machine: Machine, timeout: float = 60.0) -> None:
        """Wait until the GCS has marked ``machine``'s node dead."""
        deadline = time.monotonic() + timeout
        while self.node_alive(machine.node_id):
            if time.monotonic() > deadline:
                raise ClusterError(f"machine {machine.name} still alive for the GCS after {timeout} s")
            time.sleep(0.1)

    def freeze(self, name: str) -> None:
        """Make machine ``name`` stop answering: SIGSTOP every process of its namespace. Its
        connections stay open, so only the GCS's health checks find it dead, as after a power
        cut or a network partition. ``kill`` it afterwards."""
        m = self.machines[name]
        for _ in range(3):  # anything it was spawning at that moment too
            for pid in pids_in_namespace(m.ns):
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        """Lose machine ``name``: SIGKILL every process of its namespace (its raylet, its
        workers, its agents); its private /tmp goes with them."""
        self._kill(self.machines[name])

    def _kill(self, m: Machine, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pids = pids_in_namespace(m.ns) if m.ns else []
            if m.proc.poll() is None and m.proc.pid not in pids:
                pids.append(m.proc.pid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if m.proc.poll() is None:
                try:
                    m.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            if time.monotonic() > deadline:
                raise ClusterError(f"machine {m.name}: processes {pids} survive SIGKILL")
            time.sleep(0.05)
        m.dead = True

    def run_on(self, name: str, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
        """Run ``argv`` on machine ``name`` (in its mount namespace), e.g. to look at its disk."""
        m = self.machines[name]
        return subprocess.run(["nsenter", f"--mount=/proc/{m.proc.pid}/ns/mnt", *argv],
                              capture_output=True, timeout=30, **kw)

    def shutdown(self) -> None:
        """Disconnect the driver (if ``start`` connected it), stop every machine and the head
        (SIGKILL: nothing of theirs must survive), remove the harness's directory. Idempotent."""
        atexit.unregister(self.shutdown)
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False
        errors = []
        for m in [*self.machines.values(), *([self.head] if self.head else [])]:
            try:
                self._kill(m)
            except ClusterError as e:
                errors.append(str(e))
        shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise ClusterError("; ".join(errors))

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# -- steps for the machines' node actors (importable there: tests/ is on their PYTHONPATH)
class WhoAmI:
    """Puts the pid of the process that runs it into the workspace, as ``pid``."""

    def __call__(self, ws: Any) -> None:
        import numpy as np

        ws["pid"] = np.int64(os.getpid())


class Rendezvous:
    """Tells whoever listens on 127.0.0.1:``port`` that it has started, then blocks (a node
    busy mid-run, for the test to kill its machine)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def __call__(self, ws: Any) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            s.sendall(b"started")
            time.sleep(300)


class Listener:
    """The test's end of a ``Rendezvous``: ``step()`` to put in a task, ``wait(run)`` until it
    runs (``run``: the future of the session's run, whose error is raised if it ends first)."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.sock.settimeout(0.2)

    def step(self) -> Rendezvous:
        return Rendezvous(self.sock.getsockname()[1])

    def wait(self, run: Any) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn, _ = self.sock.accept()
                break
            except TimeoutError:
                if run.done():
                    run.result()
                    raise ClusterError("the run ended before its Rendezvous step started") from None
                if time.monotonic() > deadline:
                    raise ClusterError(f"no Rendezvous step started in {self.timeout} s") from None
        with conn:
            conn.settimeout(30)
            if conn.recv(16) != b"started":
                raise ClusterError("a Rendezvous step sent something else")

    def close(self) -> None:
        self.sock.close()
