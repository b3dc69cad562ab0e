"""Model definitions, layers, weight loading, the runner and the sampler. Never sees request text."""
