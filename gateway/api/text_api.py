"""vLLM's text endpoints: `POST /tokenize` and `POST /detokenize`.

`/tokenize` takes `prompt` (text, tokenized as `/v1/completions` does: BOS added unless
`add_special_tokens: false`) or `messages` (with optional `tools`, rendered by the chat
template as `/v1/chat/completions` does), and answers `{"count", "max_model_len", "tokens",
"token_strs"}` (`token_strs` only with `return_token_strs: true`, else null). `/detokenize`
takes `tokens` and answers `{"prompt"}`, the text as a completion's would read (special
tokens skipped). Both take `model` optionally (another model's name: 404). The cheap prompt
bound of the generation routes applies: text far beyond the context is refused untokenized.
"""

from __future__ import annotations

from typing import Any

from gateway.api.openai_api import APIHandlers
from gateway.errors import bad_request
from gateway.requests.protocol import parse_detokenize, parse_tokenize


class TextHandlers(APIHandlers):
    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse_tokenize(body, self.model.served_name)
        if isinstance(req.prompt, str):
            ids = await self.encoder.prompt(req.prompt, "prompt", req.add_special_tokens)
        else:
            ids = await self.encoder.chat(req.prompt, req.tools)
        strs = [self.codec.token_text(t) for t in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.model.context_length,
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = parse_detokenize(body, self.model.served_name)
        vocab = self.codec.vocab_size
        for i, token in enumerate(ids):
            if token >= vocab:
                raise bad_request(
                    f"tokens[{i}]", f"`tokens[{i}]` is {token}; the vocabulary has {vocab} tokens"
                )
        return {"prompt": self.codec.decode(ids)}
