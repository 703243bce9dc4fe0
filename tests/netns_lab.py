"""Network namespaces as stand-in hosts: one namespace per process, joined by veth links.

`netns_lab()` builds, for one test, a bridge in the test's own namespace with address
10.231.<n>.254/24 (so the test process reaches every host) and a `Host` per role: a namespace
with its loopback up and one veth link to the bridge, the namespace end named `pdt-<role>` and
holding 10.231.<n>.<k>/24. `Host.spawn` runs a command inside the namespace (`ip netns exec`),
in a session of its own, output to a log file. `Host.cut()` / `Host.mend()` take the host's link
down and up (`ip link set <veth> down`, the bridge end). Everything is deleted on exit,
whatever happened: processes first (SIGTERM, then SIGKILL of each session), then the links and
the namespaces. `<n>` comes from the pid, so concurrent runs do not share a subnet.

`lab_unavailable()` says why such a lab cannot be built here (not root, no `ip netns`), for
`pytest.skip`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.process.launcher import ServerProcess


class LabError(RuntimeError):
    """An `ip` command failed; the message quotes it and its output."""


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def lab_unavailable() -> str:
    """Why no lab can be built here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"pdt-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except LabError as exc:
        return f"`ip netns add` does not work here: {exc}"
    ip("netns", "del", probe, check=False)
    return ""


@dataclass
class Host:
    role: str  # "bootstrap", "prefill", ...
    namespace: str
    address: str  # its IPv4 address inside the lab
    device: str  # the veth end inside the namespace
    bridge_end: str  # the veth end on the bridge: what cut() takes down
    servers: list[ServerProcess] = field(default_factory=list)

    def spawn(
        self, command: Sequence[str], log_path: Path, env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        server = ServerProcess.start(
            Path(command[0]).name,
            ["ip", "netns", "exec", self.namespace, *command],
            log_path=log_path,
            env=env,
            shown=f"[{self.namespace}] {' '.join(command)}",
        )
        self.servers.append(server)
        return server.process

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [server.process for server in self.servers]

    def cut(self) -> None:
        ip("link", "set", self.bridge_end, "down")

    def mend(self) -> None:
        ip("link", "set", self.bridge_end, "up")

    def stop(self, timeout: float = 15.0) -> None:
        for server in self.servers:
            server.stop(timeout)
        self.servers.clear()


@dataclass
class Lab:
    tag: str  # prefix of every name the lab creates
    subnet: str  # "10.231.<n>"
    bridge: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def gateway_address(self) -> str:
        """The bridge's address: how hosts reach the test process (unused by servers)."""
        return f"{self.subnet}.254"

    def add_host(self, role: str) -> Host:
        index = len(self.hosts) + 1
        namespace = f"{self.tag}-{role}"
        device, bridge_end = f"pdt-{role[:8]}", f"{self.tag}-{index}"
        address = f"{self.subnet}.{index}"
        ip("netns", "add", namespace)
        host = Host(role, namespace, address, device, bridge_end)
        self.hosts[role] = host  # registered before any link exists: teardown finds it
        ip("link", "add", bridge_end, "type", "veth", "peer", "name", device)
        ip("link", "set", device, "netns", namespace)
        ip("link", "set", bridge_end, "master", self.bridge, "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", device)
        ip("-n", namespace, "link", "set", device, "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        return host

    def teardown(self) -> None:
        for host in self.hosts.values():
            host.stop()
        for host in self.hosts.values():
            ip("link", "del", host.bridge_end, check=False)  # deletes its peer too
            ip("netns", "del", host.namespace, check=False)
        ip("link", "del", self.bridge, check=False)


@contextlib.contextmanager
def netns_lab() -> Iterator[Lab]:
    n = os.getpid() % 250 + 1
    tag = f"pdt{os.getpid() % 100000}"
    lab = Lab(tag, f"10.231.{n}", f"{tag}-br")
    try:
        ip("link", "add", lab.bridge, "type", "bridge")
        ip("addr", "add", f"{lab.gateway_address}/24", "dev", lab.bridge)
        ip("link", "set", lab.bridge, "up")
        yield lab
    finally:
        lab.teardown()


def wait_for(
    check: Callable[[], object], what: str, timeout: float, interval: float = 0.2
) -> float:
    """Poll `check()` until truthy; the seconds it took. AssertionError naming `what` after
    `timeout`."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)
