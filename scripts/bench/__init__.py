"""Benchmarks of one part at a time: the engine, its CPU linears, a node over gRPC, the gateway's
own cost, and KV transfer (raw, across TP sizes, and the PD hand-off)."""
