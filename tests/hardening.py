"""Helpers of the security, hostile-input and overload tests (issue 8, items 4-6).

- `cluster_process`: `pd-cluster` as an operator runs it, with any of its flags;
- `make_certs`: a throwaway CA and a certificate for 127.0.0.1 signed by it (openssl CLI), plus
  a rogue self-signed one;
- `assert_openai_error`: the OpenAI error shape every gateway error must have;
- `rss_bytes`: a process's resident memory, from /proc.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.ports import free_port
from gateway.process.launcher import console_script
from tests.test_gateway import RunningCluster, launched_cluster


@contextmanager
def cluster_process(
    log_path: Path,
    model: Path,
    args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    node_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[RunningCluster]:
    """`pd-cluster --prefill 1 --decode 1` (mooncake) with extra flags; no process may be left."""
    port = free_port()
    command = [console_script("pd-cluster"), "--model", str(model), "--port", str(port)]
    command += ["--max-total-tokens", "8192", *args]
    command += ["--gateway-args", " ".join(gateway_args), "--node-args", " ".join(node_args)]
    with launched_cluster(command, port, log_path, env) as cluster:
        yield cluster


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path  # for 127.0.0.1, signed by `ca`: every process's server and client certificate
    key: Path
    rogue_cert: Path  # self-signed: no CA of the cluster vouches for it
    rogue_key: Path

    def read(self, name: str) -> bytes:
        return Path(getattr(self, name)).read_bytes()


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=pdserve-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    openssl("req", *ec[:-2], "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    (directory / "node.ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    openssl(
        "x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "node.ext",
    )  # fmt: skip
    openssl(
        "req", "-x509", *ec, "-keyout", "rogue.key", "-out", "rogue.pem", "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1",
    )  # fmt: skip
    d = directory
    return Certs(d / "ca.pem", d / "node.pem", d / "node.key", d / "rogue.pem", d / "rogue.key")


def assert_openai_error(status: int, body: Any) -> None:
    """`{"error": {"message": str, "type": str, "param": str|None, "code": str|None}}`."""
    assert isinstance(body, dict) and set(body) == {"error"}, f"{status}: {body!r}"
    error = body["error"]
    assert isinstance(error, dict), f"{status}: {body!r}"
    assert set(error) == {"message", "type", "param", "code"}, f"{status}: {body!r}"
    assert isinstance(error["message"], str) and error["message"], f"{status}: {body!r}"
    assert isinstance(error["type"], str) and error["type"], f"{status}: {body!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"{status}: {body!r}"
    assert error["code"] is None or isinstance(error["code"], str), f"{status}: {body!r}"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
