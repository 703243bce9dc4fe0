"""Builders shared by the unit tests that need no processes."""

from __future__ import annotations

from gateway.config import RoutingConfig


def routing_config(
    prefill_policy: str, decode_policy: str, local_prefill_max_tokens: int
) -> RoutingConfig:
    """The routing knobs of the policy unit tests: 3 tries, 5 s cooldown, 4-token prefix blocks."""
    return RoutingConfig(
        prefill_policy=prefill_policy,
        decode_policy=decode_policy,
        local_prefill_max_tokens=local_prefill_max_tokens,
        max_attempts=3,
        node_cooldown_s=5.0,
        prefix_block_tokens=4,
        prefix_max_blocks=1000,
        prefix_balance_slack=2,
    )
