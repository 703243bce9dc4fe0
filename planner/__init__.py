"""pd-planner: moves a running cluster's prefill/decode split to the one that best meets its SLO.

The loop (`cli`): scrape the gateway's /metrics (`window`), simulate every split of the node
budget on the last window's workload (`policy` over `capacity` and `simulator`, a node's costs
from its measured `profile`), and move the cluster (`actuators`: switch roles through the
bootstrap, scale Kubernetes Deployments, or run a local cluster).

The load model is shared with the load tool (`pdserve-bench`, scripts/serving): `datasets`
(what is sent), `arrivals` (when), `metrics` (per-request traces -> TTFT, TPOT, goodput). The
`profiler` measures a node profile with the engine in-process; it alone imports torch (lazily).
"""
