"""Expert-parallel load balancing (EPLB) for mixture-of-experts models.

- `recorder.py`: what the routers choose, counted per MoE layer and logical expert on the
  model's device (`ExpertLoadCounter`), and a start/stop window over it
  (`ExpertDistributionRecorder`) read as an `ExpertDistribution`.
- `distribution.py`: that dump (JSON): model, MoE layers, experts, counts [L, E], tokens, span.
- `placement.py`: an `ExpertPlacement`: per MoE layer the logical expert of each physical slot,
  slots split evenly over EP ranks; read, checked against the model, written.
- `balance.py`: from a distribution, a placement that replicates the hottest experts into the
  redundant slots and packs the copies over the ranks (DeepSeek's EPLB), with each rank's load
  before and after.
- `cli.py`: `pdserve-eplb`, the placement tool.
- `files.py`: the JSON of both files, read with errors that name the file and the field.

Nodes record with `--expert-distribution-out FILE` or the admin calls, and load a placement with
`--expert-placement FILE` (engine/node/experts.py, docs/operations.md).
"""
