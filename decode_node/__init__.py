"""The decode node: `decode-server` (server.py) and its role (decode_role.py: the prealloc,
transfer and running queues, KV pages pulled from a prefill node, or prefilled locally). The
process shell it shares with the prefill node lives in engine/node/."""
