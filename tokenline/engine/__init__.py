"""Requests, the scheduler, the KV block pool and the engine step loop. No HTTP, no Jinja."""
