"""The gateway process: the HTTP API (OpenAI-compatible and native), tokenization, routing,
room assignment, retries and SSE streaming; also `pd-cluster`, the local cluster launcher.

It imports no torch (tests/test_layering.py): from the engine it takes only the tokenizer loader,
the model config reader and the default-model fetcher.
"""
