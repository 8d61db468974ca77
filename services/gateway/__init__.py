"""The gateway: the OpenAI-compatible HTTP API, the routing of each request to workers over gRPC,
and the worker pool it learns from Redis. It imports no torch; `server.py` is what
`nori serve gateway` runs. docs/architecture.md, "One request, file by file", walks a request."""
