"""Code generated from the nori.v1 gRPC contracts in this folder."""
