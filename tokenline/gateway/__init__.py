"""The gateway: API keys, quotas and rate limits, byte/tool/max-token limits, request ids, the usage
ledger and cost, Prometheus metrics and per-request traces. Usable without a local engine: it
sees an ``EngineClient``'s stats, never tensors."""
