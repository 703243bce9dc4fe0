"""The gRPC stubs committed in proto/ are exactly what grpc_tools generates from proto/*.proto.

A .proto edited without regenerating (or stubs edited by hand) would otherwise only show up as
a confusing runtime error between two nodes. The command is the Makefile's `proto` target.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _stub_names(proto_stems: list[str]) -> set[str]:
    return {stem + suffix for stem in proto_stems for suffix in STUB_SUFFIXES}


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.fail("grpcio-tools is not installed: install the dev extras (`make setup`)")
    protos = sorted(p.relative_to(REPO).as_posix() for p in PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files in {PROTO_DIR}"
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        ".",
        f"--python_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        *protos,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"

    expected = _stub_names([Path(p).stem for p in protos])
    generated = {p.name for p in (tmp_path / "proto").iterdir()}
    assert generated == expected, f"protoc generated {sorted(generated)}"
    committed = {
        p.name for p in PROTO_DIR.iterdir() if p.name.endswith(STUB_SUFFIXES) and "_pb2" in p.name
    }
    stale = sorted(
        name
        for name in expected | committed
        if name not in committed
        or name not in expected
        or (PROTO_DIR / name).read_bytes() != (tmp_path / "proto" / name).read_bytes()
    )
    tools = importlib.metadata.version("grpcio-tools")
    assert not stale, (
        f"stale gRPC stubs in proto/ (missing, orphaned or different from what grpcio-tools "
        f"{tools} generates): {stale}; run `make proto` and commit the result"
    )


def test_room_messages_cross_the_node_edge_unchanged() -> None:
    """The node's room dataclasses and their wire types carry the same fields both ways."""
    from engine.node.bootstrap_link import (
        destination_from_proto,
        destination_to_proto,
        status_from_proto,
        status_to_proto,
    )
    from kvtransfer.room import RoomDestination, RoomState, RoomStatus

    dest = RoomDestination(7, "decode-1", "prefill-1", (3, 4, 5), 16, 2, 40, ticket="t")
    assert destination_from_proto(destination_to_proto(dest)) == dest
    for state in RoomState:
        status = RoomStatus(7, "prefill-1", "decode-1", state, "why", may_still_write=True)
        assert status_from_proto(status_to_proto(status)) == status
