"""pd-cluster's `--devices`: each node its own device, in turn, prefill nodes first."""

from __future__ import annotations

import pytest

from gateway.cluster import build_config, build_parser, node_devices


def _config(*argv: str):  # type: ignore[no-untyped-def]
    return build_config(build_parser().parse_args(list(argv)))


def test_devices_go_to_the_nodes_in_turn_prefill_first() -> None:
    config = _config("--prefill", "1", "--decode", "2", "--devices", "cuda:0, cuda:1")
    assert config.devices == ("cuda:0", "cuda:1")
    assert node_devices(config) == [
        ["--device", "cuda:0"],  # prefill-0
        ["--device", "cuda:1"],  # decode-0
        ["--device", "cuda:0"],  # decode-1: the devices start over
    ]


def test_without_devices_the_nodes_keep_their_own_flags() -> None:
    assert node_devices(_config("--prefill", "0", "--decode", "2")) == [[], []]


def test_a_bad_device_is_named() -> None:
    with pytest.raises(ValueError, match="--devices: 'gpu1' is not cpu, cuda or cuda:N"):
        _config("--devices", "cuda:0,gpu1")
