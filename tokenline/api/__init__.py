"""HTTP: the FastAPI app, the OpenAI protocol models and the mapping of its requests and
responses (JSON or SSE) onto the request processor. No policy lives here."""
