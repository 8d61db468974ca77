"""Conversions between nori.v1 protobuf messages and the engine's Python types."""
