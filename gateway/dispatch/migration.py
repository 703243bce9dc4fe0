"""What one choice has streamed so far, so that it can move to another node mid-stream.

The gateway owns a choice until its last token. When its decode node dies or gives it up after
tokens already reached the client, the choice is *migrated*: the next attempt sends the original
prompt plus every token streamed so far as its prompt (`GenerateRequest.resumed_tokens` says how
many of them were generated), with what is left of `max_new_tokens`. The new node continues
where the old one stopped: greedy output is the uninterrupted run's; a seeded request draws the
same tokens too, since a draw depends on (seed, token position) only (engine/sampling.py). The
client's stream goes on with the new node's tokens, none repeated and none missing, and the
choice's usage counts the tokens of every node it ran on.

`Progress` keeps the streamed tokens, the nodes tried and the number of moves;
gateway/dispatch/dispatcher.py drives the attempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_fields import MAX_NEW_TOKENS
from proto import node_pb2


@dataclass
class Progress:
    prompt_ids: list[int]
    sampling: node_pb2.SamplingParams
    streamed: list[int] = field(default_factory=list)  # token ids the client has been sent
    tried: list[str] = field(default_factory=list)  # nodes and failure of each failed attempt
    migrations: int = 0

    @property
    def started(self) -> bool:
        """True once a token reached the client: a failure can only be hidden by migrating."""
        return bool(self.streamed)

    @property
    def budget(self) -> int:
        """The choice's max_new_tokens over all its nodes."""
        if self.sampling.HasField("max_new_tokens"):
            return self.sampling.max_new_tokens
        return MAX_NEW_TOKENS.default

    @property
    def spent(self) -> bool:
        """Every token of the budget was streamed (the node died before saying it was done)."""
        return len(self.streamed) >= self.budget

    @property
    def input_ids(self) -> list[int]:
        """The next attempt's prompt: the choice's prompt and what it generated so far."""
        return self.prompt_ids + self.streamed

    def next_sampling(self) -> node_pb2.SamplingParams:
        """The next attempt's sampling: the tokens left of the budget."""
        if not self.streamed:
            return self.sampling
        sampling = node_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.max_new_tokens = self.budget - len(self.streamed)
        return sampling

    def whole(self, last: node_pb2.Finished, resumed: int) -> node_pb2.Finished:
        """The choice's `Finished` from its last node's, which started after `resumed` streamed
        tokens: usage counts the original prompt and the tokens of every node."""
        if not resumed:
            return last
        finished = node_pb2.Finished()
        finished.CopyFrom(last)
        finished.usage.prompt_tokens = len(self.prompt_ids)
        finished.usage.completion_tokens = resumed + last.usage.completion_tokens
        return finished

    def ended_by_length(self) -> node_pb2.Finished:
        """The `Finished` of a choice whose node died after streaming its last token."""
        usage = node_pb2.Usage(
            prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.streamed)
        )
        return node_pb2.Finished(finish_reason="length", usage=usage)
