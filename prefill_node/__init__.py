"""The prefill node: `prefill-server` (server.py) and its role (prefill_role.py: the bootstrap,
waiting and inflight queues, chunked prefill into the decode node's pages). The process shell it
shares with the decode node lives in engine/node/."""
