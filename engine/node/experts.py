"""A mixture-of-experts node's expert load (engine/eplb/): the Prometheus series of its
routings, the recording window that `--expert-distribution-out FILE` opens at start and the
admin call (`ExpertRecording`, `pdserve-admin expert-distribution`) steers, and the dump
written to FILE on that call's DUMP and at shutdown."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.eplb.placement import ExpertPlacement
from engine.eplb.recorder import ExpertDistributionRecorder
from engine.metrics import NodeMetrics
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from proto import node_pb2

logger = logging.getLogger("pdserve.node")

Action = node_pb2.ExpertRecordingRequest


def add_expert_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixture of experts")
    group.add_argument(
        "--expert-distribution-out",
        default=None,
        metavar="FILE",
        help="mixture-of-experts models: record the tokens routed per layer and expert from "
        "the start and write them to FILE (JSON) at shutdown and on the admin dump call "
        "(pdserve-admin expert-distribution); input of pdserve-eplb",
    )
    group.add_argument(
        "--expert-placement",
        default=None,
        metavar="FILE",
        help="mixture-of-experts models: the expert placement pdserve-eplb wrote, checked "
        "against the model at start; it lays the experts out under --ep-size (which, with "
        "--tp-size, must equal the file's ep_size; without --ep-size it changes nothing)",
    )


def expert_flags(args: argparse.Namespace, model_path: str) -> ExpertPlacement | None:
    """The MoE flags checked before the model loads: `--expert-distribution-out` refused for a
    dense model, and the `--expert-placement` file read (PlacementError names the file and the
    layer, rank or slot; the engine checks it against the model)."""
    if args.expert_distribution_out and ModelConfig.from_dir(model_path).moe is None:
        raise ValueError(
            f"--expert-distribution-out: model {model_path} has no mixture-of-experts layers; "
            "there is no expert load to record"
        )
    if not args.expert_placement:
        return None
    return ExpertPlacement.read(Path(args.expert_placement))


@dataclass
class ExpertRecording:
    """The node's recorder and where its dumps go; `act` runs on the engine thread."""

    recorder: ExpertDistributionRecorder
    out: Path | None  # --expert-distribution-out

    def act(self, action: int) -> node_pb2.ExpertRecordingResponse:
        """One admin call; RecordingError when there is no window to stop or dump."""
        answer = node_pb2.ExpertRecordingResponse()
        if action == Action.START:
            self.recorder.start()
        elif action == Action.STOP:
            answer.distribution_json = self.recorder.stop().to_text()
        else:
            dist = self.recorder.dump()
            answer.distribution_json = dist.to_text()
            if self.out is not None:
                dist.write(self.out)
                answer.written_to = str(self.out)
        answer.recording = self.recorder.recording
        return answer

    def write_at_exit(self) -> None:
        """Shutdown, the engine stopped: the window to --expert-distribution-out, if given."""
        if self.out is None:
            return
        dist = self.recorder.dump()
        dist.write(self.out)
        logger.info(
            "expert distribution: %d tokens over %.1f s written to %s",
            dist.tokens,
            dist.seconds,
            self.out,
        )


def expert_recording(
    args: argparse.Namespace, runner: ModelRunner, metrics: NodeMetrics, model_name: str
) -> ExpertRecording | None:
    """The node's expert load on `metrics` and its recorder, started with
    --expert-distribution-out (None: a dense model)."""
    counter = runner.expert_load
    if counter is None:
        return None
    metrics.watch_expert_load(counter)
    placement = runner.config.expert_placement
    if placement is not None:
        logger.info(
            "expert placement %s: %d MoE layers over %d EP ranks of %d slots (%d redundant "
            "copies a layer); %s",
            args.expert_placement,
            len(placement.layer_ids),
            placement.ep_size,
            placement.slots_per_rank,
            placement.num_redundant,
            "laid out over the node's ranks"
            if runner.config.ep_size > 1
            else "not laid out without --ep-size: every expert is local",
        )
    recording = ExpertRecording(
        ExpertDistributionRecorder(counter, Path(model_name).name),
        Path(args.expert_distribution_out) if args.expert_distribution_out else None,
    )
    if recording.out is not None:
        recording.recorder.start()
        logger.info("recording the expert distribution to %s", recording.out)
    return recording
