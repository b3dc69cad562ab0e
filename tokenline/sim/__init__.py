"""Simulate before you buy: a step-time model fitted on this machine (``calibrate``), and the real
scheduler and KV cache driven on a simulated clock by a runner that only advances time (``simulate``)."""
