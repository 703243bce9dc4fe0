"""Which nodes take a request: the live node table, the routing policies and the prefix index.

`nodes.py` follows the bootstrap's node events into the table of live nodes; `policies.py` holds
the routing policies and the router that picks a (prefill, decode) pair; `kv_feed.py` follows the
nodes' KV-cache events into `prefix_index.py`, which the `kv_aware` policy reads.
"""
