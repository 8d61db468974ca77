"""The gRPC options every Nori server and channel uses."""

# gRPC messages carry token ids and deltas, never KV blocks; 64 MiB covers the longest prompt.
MAX_MESSAGE_BYTES = 64 << 20

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive while calls are open: a peer that stops answering pings (hung, frozen, cut off)
    # fails its calls with UNAVAILABLE, so the gateway moves the request on.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # gRPC core times a ping out by this one (default 60 s), whatever keepalive_timeout says.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # A stream that waits for a long prompt carries no data for a while; keep pinging it.
    ("grpc.http2.max_pings_without_data", 0),
    # The server side: accept those pings (the default would answer them with GOAWAY).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
]
