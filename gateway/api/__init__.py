"""The HTTP surface: the Starlette app, the OpenAI and native handlers, their answers and SSE.

`app.py` checks every request (keys, sizes, admission) and routes it to `openai_api.py`,
`responses_api.py` or `native_api.py`; those parse the body (gateway/requests/), make one
`ChoiceJob` per choice and run it through the dispatcher (gateway/dispatch/); `choices.py` turns
token chunks into text events and `sse.py` encodes them. The Responses API's answers are built by
`response_items.py`, its kept conversations are `response_store.py`'s. `openapi.py` publishes
the schema of the request models.
"""
