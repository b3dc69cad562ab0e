"""Benchmarks: offline throughput through the engine, and (later) an HTTP load client."""
