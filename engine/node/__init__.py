"""The node wing: the process shell that prefill and decode nodes share around the engine.

`server.py` (load, serve, drain and shut down), `service.py` (the gRPC `Node` servicer: Generate,
Prefill, Abort, Load, CheckIntegrity), `args.py` (node flags turned into frozen configs),
`bootstrap_link.py` (registration, heartbeats and room messages with the bootstrap service),
`transfer_setup.py` (the KV transfer engine, its registered memory and the node's record) and
`tp_transfer.py` (KV transfers of a tensor-parallel node, fanned out to its ranks).
`prefill_node/` and `decode_node/` hold what is specific to each kind.
"""
