"""pd-cluster's `--devices`: each node its own device, in turn, prefill nodes first."""

from __future__ import annotations

import pytest

from gateway.process.cluster import build_config, build_parser, node_devices


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


def test_a_node_started_later_takes_the_device_of_one_stopped_before() -> None:
    from gateway.process.cluster import Cluster

    started: list[tuple[str, list[str]]] = []

    class Recording(Cluster):
        def _spawn(self, name, script, args, essential=False, port=0, metrics=False):  # type: ignore[no-untyped-def,override]
            started.append((name, list(args)))

    cluster = Recording(_config("--prefill", "1", "--decode", "1", "--devices", "cuda:0,cuda:1"))
    cluster._role_args = {"prefill": ["--p"], "decode": ["--d"]}
    cluster._devices = {"prefill-0": ["--device", "cuda:0"], "decode-0": ["--device", "cuda:1"]}
    cluster._freed_devices.append(cluster._devices["prefill-0"])  # as remove_node does
    cluster.add_node("decode")
    assert started == [("decode-0", ["--d", "--device", "cuda:0"])]  # no child recorded here


def test_kv_stream_layers_go_to_prefill_nodes_and_a_restart_may_change_them() -> None:
    from gateway.process.cluster import Cluster

    assert _config().kv_stream_layers == 0
    with pytest.raises(ValueError, match="--kv-stream-layers must be >= 0"):
        _config("--kv-stream-layers", "-1")
    started: list[tuple[str, list[str]]] = []

    class Recording(Cluster):
        def _spawn(self, name, script, args, essential=False, port=0, metrics=False):  # type: ignore[no-untyped-def,override]
            started.append((name, list(args)))

    cluster = Recording(_config("--kv-stream-layers", "4"))
    assert cluster._stream_args() == ["--kv-stream-layers", "4"]
    assert Recording(_config())._stream_args() == []  # off: the nodes' default
    cluster._role_args = {"prefill": ["--p", *cluster._stream_args()], "decode": ["--d"]}
    cluster.add_node("prefill", ["--kv-stream-layers", "8"])  # later flags win
    assert started == [("prefill-0", ["--p", "--kv-stream-layers", "4", "--kv-stream-layers", "8"])]
