"""Tensor parallelism inside one node: the head/vocab split rule (partition.py), the process
group (group.py), rank 0's step messages (messages.py) and the spawned ranks (workers.py)."""
