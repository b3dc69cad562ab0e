"""HTTP edge: OpenAI-compatible API, protocol models, errors, auth, limits and streaming."""
