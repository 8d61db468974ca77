"""The gRPC options every Nori server and channel uses."""

# gRPC messages carry token ids and deltas, never KV blocks; 64 MiB covers the longest prompt.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]
