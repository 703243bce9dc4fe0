"""The bootstrap service: node registry, heartbeats and the P/D room rendezvous.

Files: `registry.py` (live nodes, KV-layout compatibility, liveness), `rooms.py` (room table
and its state machine), `streams.py` (per-node mailboxes and the node-event broadcast),
`service.py` (the grpc.aio servicer), `server.py` (`bootstrap-server`), and `client.py` (the
async helper that nodes and the gateway use to talk to it).
"""
