"""Running one choice on the cluster: a (prefill, decode) pair, retries, migration, streaming.

`dispatcher.py`'s `Generation` waits in the decode line (`decode_line.py`) when every decode node
is full, asks the router (gateway/routing/) for a pair, sends the request through `pd_client.py`
and retries before the first token or migrates after it (`migration.py`). `lane.py` is the fast
path of a streamed token to the client's socket; `timeline.py` says where a request's time went.
"""
