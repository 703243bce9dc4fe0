"""Tools around the product: benchmarks, load and soak tests, capacity planning, GPU checks.

Each tool runs as a module from the repository root, `python -m scripts.<group>.<name>`
(scripts/README.md lists them): bench/ (one part at a time), serving/ (a running cluster under
load), planning/ (how many nodes of which kind), gpu/ (checks and figures on a GPU host).
`tiny_models` holds what the tests share with the scripts.
"""
