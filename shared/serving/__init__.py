"""What every worker process shares: the engine on its own thread, the gRPC server, registry heartbeats, shutdown."""
