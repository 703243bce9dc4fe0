"""What the gateway's /metrics say: scrapes of its counters and the window between two.

One window is the difference of two scrapes of the gateway's /metrics: the choices admitted
with their prompt tokens and token budgets (counted at admission), the requests answered (200s,
counted at the first token), the requests finished (the end-to-end histogram's count), the
requests in flight (a gauge), prompt, completion and prefix-cached tokens and the budgets of
finished choices (counted when a request finishes), the TTFT and inter-token latency
histograms' sums and counts, and the live prefill and decode nodes (the current split). From
it: the arrival rate (admissions per second: 200s are counted at the first token, so under a
prefill backlog they read the split's capacity, not the load), mean input and output lengths
of the admitted choices (outputs: their budgets times the share of its budget a finished
choice used; a record without the admission counters: per finished request), the cached
fraction of the prompts, and the measured mean TTFT and TPOT.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .splits import Split


class PlannerError(ValueError):
    """Planner input that cannot be used; the message names the flag or the metric."""


@dataclass(frozen=True)
class Scrape:
    """The gateway's cumulative counters at one moment (seconds on the planner's clock)."""

    at: float
    requests: float = 0.0  # answered with 200 on the generation endpoints (a stream opened)
    finished: float = 0.0  # requests whose tokens were counted (the e2e histogram's count)
    inflight: float = 0.0  # admitted and not finished (a gauge): queued ones included
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    cached_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    # Counted at admission (0 in a record of a gateway without them): the offered lengths.
    admitted: float = 0.0  # choices
    admitted_prompt_tokens: float = 0.0
    admitted_max_tokens: float = 0.0
    finished_max_tokens: float = 0.0  # the budgets of finished choices
    prefill_nodes: int = 0
    decode_nodes: int = 0


GENERATION_ENDPOINTS = ("completions", "chat", "generate")  # the gateway's endpoint labels
COUNTERS = {  # the gateway's cumulative samples -> Scrape fields (summed over their labels)
    "pdserve_gateway_prompt_tokens_total": "prompt_tokens",
    "pdserve_gateway_completion_tokens_total": "completion_tokens",
    "pdserve_gateway_node_cached_tokens_total": "cached_tokens",
    "pdserve_gateway_time_to_first_token_seconds_sum": "ttft_sum",
    "pdserve_gateway_time_to_first_token_seconds_count": "ttft_count",
    "pdserve_gateway_inter_token_latency_seconds_sum": "itl_sum",
    "pdserve_gateway_inter_token_latency_seconds_count": "itl_count",
    "pdserve_gateway_e2e_seconds_count": "finished",
    "pdserve_gateway_inflight": "inflight",
    "pdserve_gateway_admitted_choices_total": "admitted",
    "pdserve_gateway_admitted_prompt_tokens_total": "admitted_prompt_tokens",
    "pdserve_gateway_admitted_max_tokens_total": "admitted_max_tokens",
    "pdserve_gateway_finished_max_tokens_total": "finished_max_tokens",
}


def parse_scrape(text: str, at: float) -> Scrape:
    """One /metrics text (Prometheus exposition format) as a `Scrape`."""
    values: dict[str, float] = {}
    nodes = {"prefill": 0, "decode": 0, "colocated": 0}

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            key = COUNTERS.get(name)
            if name == "pdserve_gateway_requests_total":
                ok = labels.get("status") == "200"
                key = "requests" if ok and labels.get("endpoint") in GENERATION_ENDPOINTS else None
            elif name == "pdserve_gateway_live_nodes" and labels.get("role") in nodes:
                nodes[labels["role"]] = int(sample.value)
            if key is not None:
                values[key] = values.get(key, 0.0) + sample.value
    decode = nodes["decode"] + nodes["colocated"]  # a colocated node decodes (and prefills)
    return Scrape(at, **values, prefill_nodes=nodes["prefill"], decode_nodes=decode)


@dataclass(frozen=True)
class Window:
    """The workload and latencies between two scrapes."""

    seconds: float
    admitted: float  # requests that reached the gateway in the window
    rate: float  # requests admitted per second (the offered load)
    input_len: float  # mean prompt tokens
    output_len: float  # mean completion tokens
    cached_fraction: float  # of the prompt tokens, served from a prefix cache
    ttft_s: float | None  # mean, measured
    tpot_s: float | None  # mean inter-token latency, measured
    split: Split  # live nodes at the window's end
    tpot_samples: float = 0.0  # inter-token intervals behind tpot_s

    @classmethod
    def between(cls, a: Scrape, b: Scrape) -> Window | None:
        """None when nothing was admitted in between (with a gateway that does not count
        admissions: nothing answered, or nothing finished), so nothing to plan for."""
        seconds, requests = b.at - a.at, b.requests - a.requests
        finished = b.finished - a.finished
        counted = b.admitted > 0  # the gateway counts admissions (a record may predate them)
        admissions = b.admitted - a.admitted
        if seconds <= 0 or (admissions <= 0 if counted else (requests <= 0 or finished <= 0)):
            return None
        prompt = b.prompt_tokens - a.prompt_tokens

        def mean(s: float, c: float) -> float | None:
            return s / c if c > 0 else None

        # The rate is of admissions: counted, or without the counter finished + in flight, or
        # the 200s where more. A 200 is counted at the first token, which a backlog delays into
        # a later window: beside the counter, the larger of the two read twice the rate in 9 of
        # two-phase-7's 24 windows.
        if counted:
            admitted = admissions
            # The lengths of what arrived: the tokens of finished requests trail their
            # admission by a request's life, which read a prompt-heavy phase for a minute into
            # a decode-heavy one, and nothing at all while no request finished for 330 s
            # (benchmarks/serving-2026-11-26-two-phase-6.md). Outputs are the budgets scaled
            # by the share of their budgets that finished requests used.
            used = b.completion_tokens / b.finished_max_tokens if b.finished_max_tokens else 1.0
            input_len = (b.admitted_prompt_tokens - a.admitted_prompt_tokens) / admissions
            output_len = (b.admitted_max_tokens - a.admitted_max_tokens) / admissions * used
        else:  # a 200 is counted at the first token, the tokens at the end: per finished one
            admitted = max((b.finished + b.inflight) - (a.finished + a.inflight), requests)
            input_len = prompt / finished
            output_len = (b.completion_tokens - a.completion_tokens) / finished
        cached = (b.cached_tokens - a.cached_tokens) / prompt if prompt > 0 else None
        if cached is None:  # nothing finished in the window: the gateway's running share
            cached = b.cached_tokens / b.prompt_tokens if b.prompt_tokens > 0 else 0.0
        return cls(
            seconds=seconds,
            admitted=admitted,
            rate=admitted / seconds,
            input_len=input_len,
            output_len=output_len,
            cached_fraction=cached,
            ttft_s=mean(b.ttft_sum - a.ttft_sum, b.ttft_count - a.ttft_count),
            tpot_s=mean(b.itl_sum - a.itl_sum, b.itl_count - a.itl_count),
            split=Split(b.prefill_nodes, b.decode_nodes),
            tpot_samples=b.itl_count - a.itl_count,
        )


def scrapes_live(url: str, interval_s: float, record: Path | None) -> Iterator[Scrape]:
    while True:
        at = time.monotonic()
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        if record is not None:
            with record.open("a") as f:
                f.write(json.dumps({"at": at, "metrics": text}) + "\n")
        yield parse_scrape(text, at)
        time.sleep(max(0.0, interval_s - (time.monotonic() - at)))


def scrapes_recorded(path: Path) -> Iterator[Scrape]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            doc = json.loads(line)
            yield parse_scrape(doc["metrics"], float(doc["at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise PlannerError(
                f"--replay {path}: line {n} is not a recorded scrape ({exc})"
            ) from None
