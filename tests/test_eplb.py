"""Expert-load recording and placement (engine/eplb/): the dump and placement files, the
placement algorithm, the routers' counter, a tiny Qwen3-MoE on a Mooncake trace slice placed at
EP 2 and 4 (max / mean rank load <= 1.15 after), and a decode-server started with a placement
(with redundant copies) that records its load: token for token HF's, its Prometheus series,
the admin calls and the dump at shutdown.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bootstrap import admin
from engine import LLM
from engine.eplb import cli
from engine.eplb.balance import compare, rebalance
from engine.eplb.distribution import ExpertDistribution, merge
from engine.eplb.files import EPLBFileError
from engine.eplb.placement import ExpertPlacement, PlacementError
from engine.eplb.recorder import ExpertDistributionRecorder, ExpertLoadCounter, RecordingError
from engine.model_config import ModelConfig
from engine.models.moe import SparseMoEBlock
from engine.ports import free_port
from engine.tp.partition import full_shard
from gateway.process.launcher import running_node
from planner.datasets import load_mooncake
from proto import node_pb2
from scripts.expert_load import MAX_POSITIONS, TRACE, record
from scripts.tiny_models import hf_greedy, save_tiny_moe, write_llama_config

COUNTS = ((50, 10, 30, 10), (0, 0, 80, 20))  # two MoE layers (0 and 2) of 4 experts, top-2


def _dist(counts=COUNTS, layer_ids=(0, 2), **changes: Any) -> ExpertDistribution:
    fields = dict(model="m", layer_ids=layer_ids, num_experts=len(counts[0]), top_k=2,
                  counts=counts, started_at=10.0, ended_at=12.5)  # fmt: skip
    return ExpertDistribution(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/test_moe.py's tiny Qwen3-MoE (8 experts, top-2, MoE layers 0 and 2), with
    positions for the trace's longest prompts."""
    path = tmp_path_factory.mktemp("eplb") / "tiny-qwen3-moe"
    return save_tiny_moe(path, "qwen3_moe", max_position_embeddings=MAX_POSITIONS)


# ---- the dump ---------------------------------------------------------------------------------
def test_distribution_round_trips_and_adds_up(tmp_path: Path) -> None:
    dist = _dist()
    dist.write(tmp_path / "d.json")
    raw = json.loads((tmp_path / "d.json").read_text())
    assert (raw["tokens"], raw["seconds"], raw["num_layers"]) == (50, 2.5, 2)
    assert ExpertDistribution.read(tmp_path / "d.json") == dist
    assert dist.skew() == (2.0, 3.2)
    later = _dist(started_at=20.0, ended_at=30.0)
    both = merge([dist, later])
    assert both.counts == tuple(tuple(2 * n for n in row) for row in COUNTS)
    assert (both.started_at, both.ended_at, both.tokens) == (10.0, 30.0, 100)
    with pytest.raises(EPLBFileError, match=r"cannot add .*\(3 MoE layers \[0, 1, 2\]"):
        merge([dist, _dist(counts=(*COUNTS, COUNTS[0]), layer_ids=(0, 1, 2))])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "field 'format' is 'other', not 'pdserve-expert-distribution'"),
        ({"version": 2}, "version 2: this reads 1"),
        ({"top_k": "2"}, "field 'top_k' must be a int, got '2'"),
        ({"counts": [[1, 2, 3, 4]]}, "counts has 1 rows for 2 layer_ids"),
        ({"counts": [[1, 2, 3, 4], [1, 2, 3]]}, "counts of layer 2: need 4 counts >= 0"),
        ({"counts": [[1, 2, 3, 4], [1, 2, 3, -4]]}, "counts of layer 2: need 4 counts >= 0"),
        ({"counts": [[1, 2, 3, 4], "x"]}, "counts row 1 must be a list of integers"),
    ],
)
def test_a_bad_dump_is_refused_naming_the_field(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({**_dist().to_json(), **change}))
    with pytest.raises(EPLBFileError, match=f"{path}.*{message}"):
        ExpertDistribution.read(path)


# ---- the placement file -------------------------------------------------------------------------
def _placement_json(**changes: Any) -> dict[str, Any]:
    raw = {"format": "pdserve-expert-placement", "version": 1, "model": "m", "num_experts": 4,
           "ep_size": 2, "slots_per_rank": 3,
           "layers": [{"layer": 0, "ranks": [[0, 1, 2], [2, 3, 0]]},
                      {"layer": 2, "ranks": [[2, 0, 1], [2, 3, 1]]}]}  # fmt: skip
    return {**raw, **changes}


def test_placement_round_trips_and_fits_its_model(tmp_path: Path, tiny_moe: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_placement_json()))
    placement = ExpertPlacement.read(path)
    assert placement.slot_experts == ((0, 1, 2, 2, 3, 0), (2, 0, 1, 2, 3, 1))
    assert placement.slot_ranks == (0, 0, 0, 1, 1, 1)
    assert (placement.num_redundant, placement.copies(1)) == (2, (1, 2, 2, 1))
    placement.write(tmp_path / "again.json")
    assert ExpertPlacement.read(tmp_path / "again.json") == placement
    config = ModelConfig.from_dir(tiny_moe)
    with pytest.raises(PlacementError, match=r"has 8 experts per layer; the placement places 4"):
        placement.check_model(config)
    default = ExpertPlacement.contiguous((0, 2), 8, 4)
    default.check_model(config)
    assert default.ranks(0) == ((0, 1), (2, 3), (4, 5), (6, 7))
    one_layer = ExpertPlacement.contiguous((0,), 8, 4)
    with pytest.raises(PlacementError, match=r"has MoE layers \[0, 2\]; .* places layers \[0\]"):
        one_layer.check_model(config)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([{"layer": 0, "ranks": [[0, 1, 2], [2, 3, 9]]}], "layer 0 rank 1 slot 2: expert 9 is "
         r"outside \[0, 4\)"),
        ([{"layer": 0, "ranks": [[0, 1, 2], [2, 1, 0]]}], r"layer 0: logical experts \[3\] "
         "have no slot"),
        ([{"layer": 0, "ranks": [[0, 1, 2], [3, 0]]}], "layer 0 rank 1 has 2 slots, "
         "slots_per_rank is 3"),
        ([{"layer": 0, "ranks": [[0, 1, 2]]}], "layer 0 lists 1 ranks, ep_size is 2"),
        ([{"layer": 0, "ranks": [[0, 1, 2], [2, 3, 0]]}] * 2, r"layer ids \[0, 0\] repeat"),
        ([{"ranks": []}], "field 'layer' must be a int"),
    ],
)  # fmt: skip
def test_a_bad_placement_is_refused_naming_layer_rank_and_slot(
    tmp_path: Path, layers: list[dict[str, Any]], message: str
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_placement_json(layers=layers)))
    with pytest.raises(PlacementError, match=f"{path}: {message}"):
        ExpertPlacement.read(path)


# ---- the algorithm ------------------------------------------------------------------------------
def test_rebalance_replicates_the_hottest_and_packs_them_apart() -> None:
    """Layer 2's expert 2 carries 80 of 100 routings: it gets the copies, each on its own rank."""
    dist = _dist()
    placement = rebalance(dist, ep_size=2, slots_per_rank=3)
    assert placement == rebalance(dist, ep_size=2, slots_per_rank=3)  # deterministic
    assert placement.copies(1) == (1, 1, 2, 2)
    assert all(len(set(rank)) == len(rank) for i in range(2) for rank in placement.ranks(i))
    report = compare(dist, ExpertPlacement.contiguous((0, 2), 4, 2), placement)
    assert [(layer.before, layer.after) for layer in report.layers] == [(1.2, 1.0), (2.0, 1.0)]
    assert [layer.replicated for layer in report.layers] == [(0, 2), (2, 3)]
    assert (report.before, report.after) == (1.6, 1.0)  # (60 + 100) / (50 + 50)


@pytest.mark.parametrize(
    ("ep_size", "slots", "message"),
    [(2, 1, "2 slots: need between the 4 experts"), (2, 5, "10 slots: need between .* and 8")],
)
def test_rebalance_refuses_shapes_that_cannot_hold_the_experts(
    ep_size: int, slots: int, message: str
) -> None:
    with pytest.raises(PlacementError, match=message):
        rebalance(_dist(), ep_size, slots)


# ---- the counter and the recorder ---------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


def test_counter_adds_each_routing_of_every_moe_layer(tiny_moe: Path) -> None:
    config = ModelConfig.from_dir(tiny_moe)
    assert config.moe is not None
    torch.manual_seed(0)
    blocks = [SparseMoEBlock(config.moe, 64, full_shard(config)) for _ in range(2)]
    for block in blocks:
        for param in block.parameters():
            torch.nn.init.normal_(param)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_Layer(blocks[0]), _Layer(torch.nn.Identity()),
                                        _Layer(blocks[1])])  # fmt: skip
    counter = ExpertLoadCounter.attach(model)
    assert counter is not None and counter.layer_ids == (0, 2)
    want = torch.zeros(2, 8, dtype=torch.int64)
    for tokens in (5, 1, 33):
        x = torch.randn(tokens, 64)
        for row, block in enumerate(blocks):
            block(x)
            want[row] += torch.bincount(block.gate.route(block.gate, x)[1].flatten(), minlength=8)
    assert counter.read() == want.tolist()
    assert int(want[0].sum()) == 2 * (5 + 1 + 33)


def test_recorder_windows_are_what_the_counter_gained() -> None:
    counter = ExpertLoadCounter((0,), 4, 2, torch.device("cpu"))
    clock = iter(range(100)).__next__
    recorder = ExpertDistributionRecorder(counter, "m", lambda: float(clock()))
    with pytest.raises(RecordingError, match="nothing recorded yet"):
        recorder.dump()
    counter.counts += torch.tensor([[1, 2, 3, 4]])
    recorder.start()
    counter.counts += torch.tensor([[0, 1, 1, 0]])
    assert recorder.dump().counts == ((0, 1, 1, 0),)
    stopped = recorder.stop()
    counter.counts += 5
    assert (recorder.recording, recorder.dump()) == (False, stopped)
    assert (stopped.tokens, stopped.started_at, stopped.ended_at) == (1, 0.0, 2.0)
    recorder.start()
    assert recorder.dump().counts == ((0, 0, 0, 0),)


# ---- a recorded distribution: the Mooncake trace on the tiny Qwen3-MoE -------------------------
def test_trace_distribution_is_skewed_and_placed_within_1_15(
    tiny_moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first 32 requests of the conversation trace (16 tokens per hash id, 4 decode steps
    each): `python -m scripts.expert_load --out DIR` prints the same figures."""
    dist = record(tiny_moe, load_mooncake(TRACE)[:32], max_new_tokens=4)
    dump = tmp_path / "distribution.json"
    dist.write(dump)
    assert dist.tokens > 10_000 and max(dist.skew()) > 2.0
    results = {}
    for ep_size in (2, 4):
        out = tmp_path / f"placement-ep{ep_size}.json"
        assert cli.main([str(dump), "--ep-size", str(ep_size), "--slots-per-rank",
                         str(8 // ep_size + 1), "--out", str(out)]) == 0  # fmt: skip
        ExpertPlacement.read(out).check_model(ModelConfig.from_dir(tiny_moe))
        results[ep_size] = compare(
            dist, ExpertPlacement.contiguous(dist.layer_ids, 8, ep_size), ExpertPlacement.read(out)
        )
    with capsys.disabled():
        print(f"\nexpert skew per layer {[round(s, 2) for s in dist.skew()]}; " + "; ".join(
            f"EP {r}: max/mean rank load {rep.before:.3f} -> {rep.after:.3f}"
            for r, rep in results.items()))  # fmt: skip
    assert results[4].before > 1.15
    assert all(layer.after <= 1.15 for rep in results.values() for layer in rep.layers)
    assert "EP 4 ranks x 3 slots (4 redundant a layer)" in capsys.readouterr().out


def test_cli_refuses_a_shape_it_cannot_place(tmp_path: Path, capsys) -> None:
    _dist().write(tmp_path / "d.json")
    assert cli.main([str(tmp_path / "d.json"), "--ep-size", "3", "--slots-per-rank", "2"]) == 2
    assert "ep_size 3 must divide the 4 experts" in capsys.readouterr().err


# ---- a node with a placement: == HF, and its expert load ----------------------------------------
def _generate(node, prompt: list[int], max_new: int) -> list[int]:
    sampling = node_pb2.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    request = node_pb2.GenerateRequest(input_ids=prompt, sampling=sampling)
    return [t for m in node.stub.Generate(request, timeout=120) for t in m.chunk.token_ids]


def _expert_series(metrics_port: int) -> dict[tuple[str, str], float]:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.labels["layer"], s.labels["expert"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "pdserve_node_expert_tokens"
        for s in family.samples
    }


def _admin(action: str, address: str, out: Path) -> dict[str, Any]:
    assert admin.main(["expert-distribution", action, "--address", address, "--out", str(out)]) == 0
    return json.loads(out.read_text()) if out.exists() else {}


def test_node_with_a_placement_matches_hf_and_records_its_load(
    tiny_moe: Path, tmp_path: Path
) -> None:
    placement = rebalance(_dist(counts=((9, 1, 1, 1, 1, 1, 1, 1),) * 2), 4, 3)
    assert placement.num_redundant == 4 and max(placement.copies(0)) > 1
    placement.write(tmp_path / "placement.json")
    prompts = [[(7 * i + j) % 255 + 1 for j in range(n)] for i, n in enumerate((5, 40, 17))]
    max_new = 8
    out, metrics_port = tmp_path / "dist.json", free_port()
    args = ["--model", str(tiny_moe), "--max-total-tokens", "2048", "--chunked-prefill-size",
            "32", "--expert-placement", str(tmp_path / "placement.json"),
            "--expert-distribution-out", str(out), "--metrics-port", str(metrics_port)]  # fmt: skip
    log = tmp_path / "node.log"
    with running_node("decode-server", args, log, env={"OMP_NUM_THREADS": "1"}) as node:
        assert [_generate(node, p, max_new) for p in prompts] == hf_greedy(
            tiny_moe, prompts, max_new
        )
        computed = sum(len(p) + max_new - 1 for p in prompts)  # the last token runs no forward
        series = _expert_series(metrics_port)
        assert len(series) == 2 * 8
        assert [sum(v for (layer, _), v in series.items() if layer == str(i)) for i in (0, 2)] == [
            2 * computed
        ] * 2
        dump = _admin("dump", node.address, tmp_path / "dump.json")
        assert dump["tokens"] == computed == json.loads(out.read_text())["tokens"]
        _admin("stop", node.address, tmp_path / "stopped.json")
        _admin("start", node.address, tmp_path / "started.json")
        _generate(node, prompts[0], 2)
        assert (
            _admin("dump", node.address, tmp_path / "again.json")["tokens"] == len(prompts[0]) + 1
        )
    assert json.loads(out.read_text())["tokens"] == len(prompts[0]) + 1  # written at shutdown
    assert "not laid out without --ep-size" in log.read_text()


def test_node_flags_refuse_what_the_model_cannot_take(tiny_moe: Path, tmp_path: Path) -> None:
    from engine.node.args import engine_config
    from engine.node.server import node_parser

    parse = node_parser("decode-server", "").parse_args
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_placement_json()))
    config = engine_config(parse(["--expert-placement", str(path)]), str(tiny_moe))
    with pytest.raises(PlacementError, match=r"--expert-placement: model .* has 8 experts"):
        LLM(str(tiny_moe), expert_placement=config.expert_placement)
    dense = str(write_llama_config(tmp_path / "dense"))
    with pytest.raises(ValueError, match=r"--expert-distribution-out: model .* has no mixture-of"):
        engine_config(parse(["--expert-distribution-out", "d.json"]), dense)


def test_a_dense_node_refuses_the_admin_call() -> None:
    from engine.node.service import NodeService

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(f"{code.name}: {details}")

    service = NodeService(Mock(), "colocated", "SmolLM2")
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: this node's model SmolLM2 has no"):
        asyncio.run(service.ExpertRecording(node_pb2.ExpertRecordingRequest(), Context()))


def test_pd_pair_records_prefill_and_decode_apart(
    tiny_moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The prefill node records from its start, the decode node from the admin call (nodes
    named through the bootstrap); pdserve-eplb adds their dumps up."""
    from gateway.process.launcher import pd_trio

    ExpertPlacement.contiguous((0, 2), 8, 2).write(tmp_path / "placement.json")
    prompts = [[(5 * i + j) % 255 + 1 for j in range(n)] for i, n in enumerate((9, 33, 20))]
    max_new = 6
    sampling = node_pb2.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    p_out = tmp_path / "prefill.json"
    with pd_trio(
        tmp_path,
        tiny_moe,
        "mooncake",
        node_args=["--expert-placement", str(tmp_path / "placement.json")],
        prefill_args=["--expert-distribution-out", str(p_out)],
        env={"OMP_NUM_THREADS": "1"},
    ) as trio:
        bootstrap = ["--bootstrap", trio.bootstrap.address]
        command = ["expert-distribution", "dump", trio.decode_id, *bootstrap]
        assert admin.main(command) == 1
        assert "refused dump: nothing recorded yet" in capsys.readouterr().err
        assert admin.main(["expert-distribution", "start", trio.decode_id, *bootstrap]) == 0
        results = trio.generate_many(prompts, sampling)
        assert [r.token_ids for r in results] == hf_greedy(tiny_moe, prompts, max_new)
        d_out = tmp_path / "decode.json"
        assert admin.main([*command, "--out", str(d_out)]) == 0
        assert json.loads(d_out.read_text())["tokens"] == len(prompts) * (max_new - 1)
        p_dump = tmp_path / "prefill-dump.json"
        assert admin.main(["expert-distribution", "dump", trio.prefill_id, *bootstrap,
                           "--out", str(p_dump)]) == 0  # fmt: skip
        assert json.loads(p_dump.read_text())["tokens"] == sum(map(len, prompts))
        trio.check_no_leaks()
    assert cli.main([str(p_out), str(d_out), "--ep-size", "2", "--slots-per-rank", "5"]) == 0
    total = sum(map(len, prompts)) + len(prompts) * (max_new - 1)
    assert f"(2 files): 2 MoE layers x 8 experts, top-2, {total} tokens" in capsys.readouterr().out
