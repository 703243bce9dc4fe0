"""A bare HTTP sink: the floor of what receiving a body costs on this host (issue 25).

    python -m scripts.serving.sink PORT

An ASGI app on uvicorn with the gateway's event loop and parser (uvloop, httptools) that reads
each request's body, discards it and answers 400. scripts/serving/hostile_probe.py sends its
8 x 3.9 MB burst here as well as to the gateway: the one-token request's latency during the
sink's burst is what the senders and the loopback transfer alone cost the cluster on a shared
host, with nothing parsed or validated.
"""

from __future__ import annotations

import sys

import uvicorn
from starlette.types import Receive, Scope, Send

ANSWER = b'{"error": {"message": "discarded by the sink", "type": "invalid_request_error"}}'


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m scripts.serving.sink PORT", file=sys.stderr)
        return 2
    uvicorn.run(app, host="127.0.0.1", port=int(args[0]), loop="uvloop", http="httptools",
                log_level="warning")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
