"""Tools around the product that a user or a developer reruns: load and soak tests, capacity
planning, CPU micro-benchmarks, the GPU suite (scripts/README.md lists them).

Each runs as a module from the repository root: serving/ (a running cluster under load; the load
tool is also the `pdserve-bench` console script), planning/ (profiles, simulated and measured
splits, the planner's goal benchmark), bench/ (one part at a time), gpu/ (one entry point,
`python -m scripts.gpu <sub-command>`). `flags` holds the flags the tools share; `tiny_models`
and `structured_schemas` hold what the tests share with the tools.
"""
