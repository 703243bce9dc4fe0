"""Request bodies from bytes to frozen requests: the models, their fields, text and tokens.

Safe against hostile clients (issue 25): `body.py` bounds depth and size, `parse_process.py`
parses a large body in a child process, `tokenize.py` bounds and tokenizes prompts off the event
loop, `memory.py` hands memory back after large requests. `protocol.py` declares the bodies
(pydantic, fields from `fields.py`, tools and grammars from `tools.py` and `structured.py`),
`responses.py` the Responses API's; `text.py` is the tokenizer, the chat template and the
streaming detokenizer.
"""
