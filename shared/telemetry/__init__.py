"""Traces (OpenTelemetry, exported over OTLP) and the metrics server every role shares."""
