"""The gateway as a process: `gateway-server`, its workers and limits; `pd-cluster` and launcher.

`server.py` turns flags into a `GatewayConfig` and serves the app (gateway/api/) on uvicorn;
`workers.py` runs N such processes on one port, `cpus.py` pins them; `connections.py` bounds what
a slow or careless client may hold. `cluster.py` (`pd-cluster`) starts a whole local cluster with
`launcher.py`, the one launcher of server processes that the tests and scripts use too.
"""
