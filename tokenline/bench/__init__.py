"""Benchmarks: offline throughput through the engine, and a streaming load client for OpenAI-compatible servers."""
