"""Addresses a node gives its peers when it is not on 127.0.0.1 (see tests/test_multihost.py)."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from engine.node.args import add_node_args, advertised_host, node_address
from kvtransfer.nixl import net_device_for


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return parser.parse_args(list(argv))


def test_advertised_host_defaults_to_the_listen_host() -> None:
    assert node_address(_args("--host", "10.0.0.7", "--port", "31000")) == "10.0.0.7:31000"
    args = _args("--host", "0.0.0.0", "--advertise-host", "10.0.0.7", "--port", "31000")
    assert node_address(args) == "10.0.0.7:31000"


def test_a_wildcard_listen_host_needs_an_advertised_one() -> None:
    with pytest.raises(ValueError, match=r"--host 0\.0\.0\.0 listens on every interface"):
        advertised_host(_args("--host", "0.0.0.0"))


def test_nixl_picks_the_interface_of_the_node_address() -> None:
    """UCX_NET_DEVICES for a node bound to an address: the interface `ip` lists it on."""
    listing = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True)
    if listing.returncode != 0:
        pytest.skip("no `ip` command to compare with")
    pairs = [
        (f[1], f[3].split("/")[0]) for f in (line.split() for line in listing.stdout.splitlines())
    ]
    assert pairs, listing.stdout
    for device, address in pairs:
        assert net_device_for(address) == device.split("@")[0]
    assert net_device_for("localhost") == "lo"
    assert net_device_for("0.0.0.0") == ""  # a wildcard: UCX picks its devices itself
    assert net_device_for("203.0.113.77") == ""  # held by no interface here
