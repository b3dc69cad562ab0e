"""The live pipeline page (``GET /dashboard``) and its data stream (``GET /v1/events``).

The page is static HTML + JS shipped in the package, with uPlot vendored beside it (nothing is
fetched at run time, nothing is built at install). It reads ``/v1/events`` with ``fetch`` so it
can send the API key as a Bearer header (``EventSource`` cannot send headers).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from tokenline.gateway.errors import APIError
from tokenline.gateway.live_events import LiveEvents, hello_event

STATIC_DIR = Path(__file__).parent / "static" / "dashboard"
# Served by name only (no paths from the URL reach the filesystem).
PAGE_FILES = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
}
STATS_INTERVAL_S = 1.0  # a stats event at least this often: the load panels and a keep-alive


def install_dashboard(app: FastAPI, events: LiveEvents, keys_configured: bool, model: str) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_file(name: str) -> Response:
        media_type = PAGE_FILES.get(name)
        if media_type is None:
            raise APIError.not_found(f"no page file named {name[:64]!r}", param="name")
        return FileResponse(STATIC_DIR / name, media_type=media_type)

    # Not in /openapi.json: an endless stream is no operation a client generator or fuzzer can use.
    @app.get("/v1/events", include_in_schema=False)
    async def live_events(request: Request) -> Response:
        tenant = request.state.tenant
        name = tenant.name if tenant is not None else None
        see_all = not keys_configured or (tenant is not None and tenant.admin)
        subscriber = events.subscribe(name, see_all)

        async def frames() -> AsyncIterator[bytes]:
            try:
                yield hello_event(name, see_all, events.capacity, model).encode()
                yield events.stats_event().encode()
                last_stats = time.monotonic()
                while not events.closed:  # closed: the server is shutting down
                    batch = await subscriber.take(STATS_INTERVAL_S)
                    if time.monotonic() - last_stats >= STATS_INTERVAL_S:
                        batch.append(events.stats_event())
                        last_stats = time.monotonic()
                    if batch:
                        yield b"".join(e.encode() for e in batch)
            finally:
                events.unsubscribe(subscriber)

        return StreamingResponse(frames(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
