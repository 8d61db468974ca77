"""What the prefill and decode workers share: the engine on its own thread, its output streams,
the worker lifecycle (registry, gRPC server, drain), CPU binding and the KV buffer layout."""
