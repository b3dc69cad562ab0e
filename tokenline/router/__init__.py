"""The fleet: routing policies, and the ``EngineClient``s that put many engines behind one gateway."""
