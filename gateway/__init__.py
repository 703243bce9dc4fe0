"""The gateway process: the HTTP API (OpenAI-compatible and native), tokenization, routing,
room assignment, retries and SSE streaming; also `pd-cluster`, the local cluster launcher.

Its rooms, each importing only those below it (pyproject.toml, [tool.importlinter]):
- `process/`: the server, its workers and connection limits; `pd-cluster` and the launcher;
- `api/`: the HTTP surface: the app, the OpenAI and native handlers, SSE, the OpenAPI document;
- `requests/`: request bodies, their models and fields, tools, tokenizing and text;
- `dispatch/`: one choice on a (prefill, decode) pair: retries, migration, the fast lane;
- `routing/`: the live nodes, the routing policies and the global prefix index;
- `config.py`, `errors.py`, `metrics.py`: the frozen configuration, the error answers and the
  Prometheus metrics that every room shares.

It imports no torch (tests/test_layering.py): from the engine it takes only the tokenizer loader,
the model config reader and the default-model fetcher.
"""
