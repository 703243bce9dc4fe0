"""Benchmarks of one part at a time: the engine, its CPU linears, a node over gRPC, the gateway's
own cost (latency added; CPU per token against fake nodes)."""
