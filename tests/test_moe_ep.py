"""Expert parallelism inside a node (`--ep-size`, engine/models/moe_dispatch.py): the routed
experts sharded whole over a node's ranks, tokens carried to them by all-to-all (gloo on CPU).

Units: the placement and its copies, the all-to-all dispatch and combine against one rank's
grouped compute (two spawned ranks, random inputs, ranks and experts without tokens, a placement
with copies), a rank's loader reading only its experts (and, with an expert-placement file, each
layer's slots of the file), refusals naming the flag. End to end, greedy output equal to HF
transformers (fp32) for Qwen3-MoE, Mixtral and dots.llm1 at TP=2 EP=2, for Qwen3-MoE laid out by
a placement file with redundant copies, and through prefill/decode pairs whose nodes differ in
EP and TP size.
"""

from __future__ import annotations

import json
import multiprocessing
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cli import main as generate_main
from engine.config import EngineConfig
from engine.eplb.placement import ExpertPlacement
from engine.model_config import ModelConfig
from engine.models import loader
from engine.models.expert_compute import grouped_experts
from engine.models.moe_dispatch import ExpertDispatch
from engine.node.args import engine_config
from engine.ports import free_port
from engine.tp.expert_placement import ExpertSlots
from engine.tp.group import TPGroup, TPInit
from engine.tp.partition import TPConfigError, plan_tp, rank_parameters, split_sizes
from tests.helpers import moe_fixtures
from tests.test_node_args import node_args

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
FAMILIES = ("qwen3_moe", "mixtral", "dots1")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (3, 29, 50, 11)]


moe_model, hf_reference = moe_fixtures(
    {family: (family, {}) for family in FAMILIES}, _prompts(), GREEDY.max_new_tokens
)


# ---- placement ----------------------------------------------------------------------------------
def test_contiguous_placement_gives_each_rank_a_block_and_copies_beyond_ep() -> None:
    two = ExpertSlots.contiguous(8, 2, 2)
    assert [two.local_experts(r) for r in (0, 1)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert two.copies()[5] == (5,) and two.local_slots(1, 5) == (1,) and not two.local_slots(0, 5)
    four = ExpertSlots.contiguous(8, 2, 4)  # each block on 2 ranks: two copies of each
    assert [four.local_experts(r)[0] for r in range(4)] == [0, 4, 0, 4]
    assert four.copies()[5] == (5, 13)


@pytest.mark.parametrize(
    ("slots", "reason"),
    [((0, 1, 2), "cannot give 2 ranks"), ((0, 1, 2, 4), r"outside \[0, 4\)"),
     ((0, 1, 1, 2), r"experts \[3\] no slot")],
)  # fmt: skip
def test_malformed_placement_is_refused(slots: tuple[int, ...], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        ExpertSlots(4, 2, slots)


def test_copies_of_an_expert_take_alternate_tokens() -> None:
    placement = ExpertSlots(6, 2, (0, 1, 2, 3, 2, 3, 4, 5))  # expert 2: slots 2 and 4
    dispatch = ExpertDispatch(placement, 0, TPGroup.single())
    ids = torch.tensor([[2, 0]] * 4)
    assert dispatch.physical_slots(ids, 0).tolist() == [2, 0, 4, 0, 2, 0, 4, 0]
    assert dispatch.physical_slots(ids, 5).tolist()[:4] == [4, 0, 2, 0]  # tokens 5 and 6


# ---- dispatch and combine over two spawned ranks ------------------------------------------------
@dataclass(frozen=True)
class DispatchCase:
    name: str
    tokens: int
    physical_to_logical: tuple[int, ...]
    experts_used: int  # the router picks among experts [0, experts_used) only


HIDDEN, INTER, TOP_K = 16, 12, 2
DISPATCH_CASES = [
    DispatchCase("spread", 37, tuple(range(8)), 8),
    DispatchCase("one token: rank 1 routes none", 1, tuple(range(8)), 8),
    DispatchCase("rank 1's experts get none", 9, tuple(range(8)), 3),
    DispatchCase("copies of experts 2 and 3", 23, (0, 1, 2, 3, 2, 3, 4, 5), 6),
]


def _case_inputs(case: DispatchCase) -> tuple[torch.Tensor, ...]:
    """(x, w13, w2 of every logical expert, weights, ids); x[:, 0] holds the token's index, which
    the test's router reads to give each token its drawn experts."""
    gen = torch.Generator().manual_seed(case.tokens)
    experts = max(case.physical_to_logical) + 1
    x = torch.randn(case.tokens, HIDDEN, generator=gen)
    x[:, 0] = torch.arange(case.tokens, dtype=torch.float32)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / 4
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) / 4
    ids = torch.rand(case.tokens, case.experts_used, generator=gen).argsort(dim=-1)[:, :TOP_K]
    weights = torch.rand(case.tokens, TOP_K, generator=gen)
    return x, w13, w2, weights, ids


def _dispatch_rank(rank: int, init_method: str, errors: Any) -> None:
    group = TPGroup.join(TPInit(2, rank, init_method, "cpu", timeout_s=60))
    try:
        for case in DISPATCH_CASES:
            x, w13, w2, weights, ids = _case_inputs(case)
            experts = max(case.physical_to_logical) + 1
            placement = ExpertSlots(experts, 2, case.physical_to_logical)
            local = list(placement.local_experts(rank))

            def route(rows: torch.Tensor, weights=weights, ids=ids) -> tuple[torch.Tensor, ...]:
                token = rows[:, 0].long()
                return weights[token], ids[token]

            got = ExpertDispatch(placement, rank, group)(x, route, w13[local], w2[local])
            want = grouped_experts(x, w13, w2, weights, ids)
            blocks = split_sizes(case.tokens, 2)
            mine = slice(sum(blocks[:rank]), sum(blocks[: rank + 1]))
            torch.testing.assert_close(got[mine], want[mine], msg=case.name)
            got[mine] = 0
            assert not got.any(), f"{case.name}: rows of the other rank's tokens are not zero"
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        group.close()


def test_all_to_all_dispatch_equals_one_ranks_grouped_compute() -> None:
    """Each rank's rows equal `grouped_experts` over every expert on one rank, the other rows
    zero (the decoder layer's all-reduce adds them): tokens spread, a rank with no token to
    route, a rank whose experts get none, a placement with copies on both ranks."""
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [ctx.Process(target=_dispatch_rank, args=(r, method, errors)) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(120)
    for proc in ranks:
        if proc.is_alive():  # its peer failed and left it waiting in a collective
            proc.kill()
            proc.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert [p.exitcode for p in ranks] == [0, 0], "\n".join(failures)


# ---- loading -------------------------------------------------------------------------------------
def test_a_rank_reads_and_holds_only_its_experts(moe_model, monkeypatch) -> None:
    """Rank 1 of EP=2: its slots are experts 4-7 whole, equal to the checkpoint's; no tensor
    of experts 0-3 is read; its routed weights are what the memory planner counts."""
    from safetensors import safe_open

    model_dir = moe_model("dots1")
    config = ModelConfig.from_dir(model_dir)
    assert config.moe is not None
    read: list[str] = []

    class RecordingHandle:
        def __init__(self, path: str, framework: str) -> None:
            self._open = safe_open(path, framework=framework)

        def __enter__(self) -> RecordingHandle:
            self._handle = self._open.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._open.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self._handle.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self._handle.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", RecordingHandle)
    shard = plan_tp(config, 2, 2)[1]
    model = loader.load_model(config, "safetensors", torch.float32, torch.device("cpu"), shard)
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts_read == {4, 5, 6, 7}
    layer = sorted(config.moe.layers)[0]
    name = f"model.layers.{layer}.mlp.experts.5.down_proj.weight"
    with safe_open(str(_file_of(model_dir, name)), framework="pt") as handle:
        torch.testing.assert_close(model.layers[layer].mlp.experts.w2[1], handle.get_tensor(name))
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts.w" in n)
    total = len(config.moe.layers) * config.moe.routed_parameters(config.hidden_size)
    assert routed == total // 2
    assert rank_parameters(config, 2, 2) == rank_parameters(config, 2, 1)  # E/2 whole = I/2 rows
    assert rank_parameters(config, 4, 2) - rank_parameters(config, 4, 1) == total // 4


def _file_of(model_dir: Path, name: str) -> Path:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return model_dir / index["weight_map"][name]


def _placement_file(config: ModelConfig) -> ExpertPlacement:
    """EP 2 over 8 experts, 5 slots a rank: each layer two redundant copies, not the same in
    consecutive MoE layers (expert 7 and 0 on both ranks; expert 1 twice on rank 0, 2 on both)."""
    assert config.moe is not None and config.moe.num_experts == 8
    patterns = ((7, 0, 3, 5, 1, 2, 4, 6, 7, 0), (1, 1, 2, 3, 4, 5, 6, 7, 0, 2))
    layers = tuple(sorted(config.moe.layers))
    slots = tuple(patterns[i % 2] for i in range(len(layers)))
    return ExpertPlacement(8, 2, 5, layers, slots)


def test_each_rank_holds_the_placement_files_experts(moe_model) -> None:
    """With --expert-placement each rank's slots of each layer are the checkpoint's experts the
    file names for them, copies included."""
    from safetensors import safe_open

    model_dir = moe_model("qwen3_moe")
    config = ModelConfig.from_dir(model_dir)
    placement = _placement_file(config)
    assert len(placement.layer_ids) > 1
    inter = config.moe.intermediate_size if config.moe else 0
    for rank, shard in enumerate(plan_tp(config, 2, 2, placement)):
        model = loader.load_model(config, "safetensors", torch.float32, torch.device("cpu"), shard)
        for i, layer in enumerate(placement.layer_ids):
            experts = model.layers[layer].mlp.experts
            assert experts.w13.shape[0] == placement.slots_per_rank
            for slot, expert in enumerate(placement.ranks(i)[rank]):
                prefix = f"model.layers.{layer}.mlp.experts.{expert}"
                for proj, got in (("gate_proj", experts.w13[slot, :inter]),
                                  ("up_proj", experts.w13[slot, inter:]),
                                  ("down_proj", experts.w2[slot])):  # fmt: skip
                    name = f"{prefix}.{proj}.weight"
                    with safe_open(str(_file_of(model_dir, name)), framework="pt") as handle:
                        torch.testing.assert_close(got, handle.get_tensor(name), msg=name)
    assert rank_parameters(config, 2, 2, placement) > rank_parameters(config, 2, 2)


# ---- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tp", "ep", "reason"),
    [(2, 3, r"ep_size 3 \(--ep-size\) must divide the node's 2 ranks"),
     (1, 2, r"ep_size 2 \(--ep-size\) must divide the node's 1 ranks"),
     (3, 3, r"ep_size 3 \(--ep-size\) must divide .*'s 8 routed experts")],
)  # fmt: skip
def test_ep_sizes_that_do_not_divide_are_refused(moe_model, tp: int, ep: int, reason: str) -> None:
    with pytest.raises(TPConfigError, match=reason):
        plan_tp(ModelConfig.from_dir(moe_model("qwen3_moe")), tp, ep)


def test_ep_on_a_dense_model_and_bad_sizes_are_refused_naming_the_flag(
    tiny_model_dir, moe_model, capsys
) -> None:
    with pytest.raises(TPConfigError, match=r"ep_size 2 \(--ep-size\) .* dense model"):
        LLM(str(tiny_model_dir("llama")), tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match="ep_size must be >= 1, got 0"):
        EngineConfig(model_path="m", ep_size=0)
    argv = ["--model", str(moe_model("mixtral")), "--tp-size", "2", "--ep-size", "3"]
    assert generate_main([*argv, "--prompt", "hi"]) == 2
    assert "ep_size 3 (--ep-size) must divide the node's 2 ranks" in capsys.readouterr().err
    assert engine_config(node_args("--tp-size", "2", "--ep-size", "2"), "m").ep_size == 2


def test_a_placement_file_of_another_ep_size_or_rank_count_is_refused(moe_model) -> None:
    config = ModelConfig.from_dir(moe_model("qwen3_moe"))
    placement = _placement_file(config)
    with pytest.raises(TPConfigError, match=r"--expert-placement places .* over 2 EP ranks, but "
                       r"--ep-size is 4: serve it with --ep-size 2"):  # fmt: skip
        plan_tp(config, 4, 4, placement)
    with pytest.raises(TPConfigError, match=r"--tp-size 4 with --ep-size 2 is not supported; "
                       r"use --tp-size 2 --ep-size 2"):  # fmt: skip
        plan_tp(config, 4, 2, placement)
    four = ExpertPlacement.contiguous(placement.layer_ids, 8, 4)
    with pytest.raises(TPConfigError, match=r"over 4 EP ranks, but --ep-size is 2"):
        LLM(str(moe_model("qwen3_moe")), tp_size=2, ep_size=2, expert_placement=four)
    assert plan_tp(config, 1, 1, placement)[0].expert_layout is None  # EP 1: not laid out


# ---- end to end ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_matches_hf(moe_model, hf_reference, family: str) -> None:
    """TP=2, EP=2: each rank holds half the experts whole; chunks split prompts; a lone request
    decodes one token a step, so rank 1 routes none."""
    llm = LLM(
        str(moe_model(family)),
        tp_size=2,
        ep_size=2,
        page_size=4,
        chunked_prefill_size=24,
        max_total_tokens=2048,
    )
    try:
        moe = llm.model_config.moe
        assert moe is not None
        w13 = llm.runner.model.layers[-1].mlp.experts.w13
        assert w13.shape == (moe.num_experts // 2, 2 * moe.intermediate_size, 64)
        assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == hf_reference(family)
        alone = llm.generate(_prompts()[:1], GREEDY)[0]
        assert alone.token_ids == hf_reference(family)[0]
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_ep2_laid_out_by_a_placement_file_matches_hf(moe_model, hf_reference) -> None:
    """TP=2, EP=2 by a placement file with redundant copies, different per layer: tokens of a
    copied expert split over its copies, output as HF's."""
    model_dir = moe_model("qwen3_moe")
    placement = _placement_file(ModelConfig.from_dir(model_dir))
    llm = LLM(str(model_dir), tp_size=2, ep_size=2, page_size=4, chunked_prefill_size=24,
              max_total_tokens=2048, expert_placement=placement)  # fmt: skip
    try:
        layer = placement.layer_ids[0]
        assert llm.runner.model.layers[layer].mlp.experts.w13.shape[0] == 5
        assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == hf_reference("qwen3_moe")
        llm.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("family", "prefill_args", "decode_args"),
    [("qwen3_moe", ["--tp-size", "2", "--ep-size", "2"], []),
     ("dots1", [], ["--tp-size", "2", "--ep-size", "2"])],
)  # fmt: skip
def test_pd_across_ep_sizes_matches_hf(
    tmp_path: Path, moe_model, hf_reference, family: str, prefill_args, decode_args
) -> None:
    """KV moves between nodes of different EP and TP sizes as between TP sizes: attention's
    KV heads are laid out by TP alone (mooncake)."""
    from gateway.process.launcher import pd_trio
    from proto import node_pb2
    from tests.helpers import generate_as_reference

    greedy = node_pb2.SamplingParams(
        max_new_tokens=GREEDY.max_new_tokens, temperature=0.0, ignore_eos=True
    )
    with pd_trio(
        tmp_path,
        moe_model(family),
        "mooncake",
        node_args=["--max-total-tokens", "2048", "--page-size", "16"],
        prefill_args=["--chunked-prefill-size", "32", *prefill_args],
        decode_args=decode_args,
    ) as cluster:
        generate_as_reference(cluster, _prompts(), greedy, hf_reference(family))
        cluster.check_no_leaks()
