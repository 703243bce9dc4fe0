"""The prefill node: `prefill-server` (server.py) and its role (prefill_role.py: the bootstrap,
waiting and inflight queues, chunked prefill into the decode node's pages; layer_stream.py: a
chunk's KV streamed by layer group with `--kv-stream-layers`). The process shell it
shares with the decode node lives in engine/node/."""
