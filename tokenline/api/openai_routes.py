"""The OpenAI-compatible routes: models, chat and text completions, and vLLM's /tokenize and
/detokenize. Chat and completions go to their serving classes, or to the pass-through when the
upstreams are hosted OpenAI-compatible APIs."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenline.api.chat_serving import ChatServing
from tokenline.api.completion_serving import CompletionServing
from tokenline.api.openapi_doc import success
from tokenline.api.passthrough import PassthroughServing
from tokenline.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenline.engine.client import EngineClient
from tokenline.frontend.text_pool import text_size
from tokenline.gateway.errors import APIError, shorten
from tokenline.gateway.gateway import Gateway, RequestContext


def openai_router(
    client: EngineClient,
    gateway: Gateway,
    serving: ChatServing,
    completion_serving: CompletionServing,
    passthrough: PassthroughServing | None,
    model_names: Sequence[str],
    model_dir: Path,
) -> APIRouter:
    """``model_names``: the served name first, then its aliases."""
    router = APIRouter()
    served_model_name = model_names[0]
    tokenizer = serving.tokenizer

    def context(request: Request, model: str | None) -> RequestContext:
        return gateway.open(request.scope["state"], model)

    created = int(time.time())  # when this server started serving the model

    def model_card(name: str) -> dict[str, Any]:
        info = client.info
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tokenline",
            "root": str(model_dir),
            "max_model_len": info.max_model_len if info else None,
        }

    @router.get("/v1/models", response_model=None, responses=success(ModelList))
    async def models(request: Request) -> dict[str, Any]:
        # One card per served name (vLLM's aliases), each shown only to tenants that may use it.
        visible = [name for name in model_names if gateway.allows_model(request.state.tenant, name)]
        return {"object": "list", "data": [model_card(name) for name in visible]}

    @router.get("/v1/models/{model_id:path}", response_model=None, responses=success(ModelCard))
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        if model_id not in model_names or not gateway.allows_model(request.state.tenant, model_id):
            raise APIError.not_found(
                f"The model `{shorten(model_id)}` does not exist.", param="model", code="model_not_found"
            )
        return model_card(model_id)

    @router.post("/v1/chat/completions", responses=success(ChatCompletionResponse, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ctx = context(request, body.model)
        gateway.check_limits(len(body.messages), body.requested_max_tokens, body.param_names["max_tokens"])
        if passthrough is not None:
            return await passthrough.chat(body, request, ctx)
        return await serving.chat(body, request, ctx)

    @router.post("/v1/completions", responses=success(CompletionResponse, stream=True))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx = context(request, body.model)
        gateway.check_limits(0, body.requested_max_tokens, "max_tokens")
        if passthrough is not None:
            return await passthrough.completion(body, request, ctx)
        return await completion_serving.completion(body, request, ctx)

    async def admit_text_work(request: Request, model: str | None) -> RequestContext:
        """/tokenize and /detokenize: the model must exist and the tenant may use it (omitted: any
        served name it may use), and the request counts against the tenant's RPM."""
        serving.check_model(model)
        if model is None:
            tenant = request.state.tenant
            model = next((name for name in model_names if gateway.allows_model(tenant, name)), served_model_name)
        return await gateway.admit_text_work(request.scope["state"], model)

    @router.post("/tokenize", response_model=None, responses=success(TokenizeResponse))
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        body.check()
        size = len(body.prompt) if body.prompt is not None else text_size(body.template_messages())
        ctx = await admit_text_work(request, body.model)
        info = client.info

        def work() -> bytes:
            if body.messages is not None:
                tokens = serving.render_chat(body)
            else:
                # As a completion prompt: special-token strings stay text unless the operator opted in.
                tokens = serving.processor.encode(body.prompt or "", add_special_tokens=body.use_special_tokens)
            # Serialized here too: FastAPI's encoder takes seconds over a million ids.
            payload = {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len if info else None}
            if body.return_token_strs:  # vLLM's: each token's string in the vocabulary (e.g. "Ġworld")
                payload["token_strs"] = [tokenizer.id_to_token(t) or "" for t in tokens]
            return json.dumps(payload, separators=(",", ":")).encode()

        # Off the event loop, bounded, in the tenant's line (frontend/text_pool.py): a 4 MB body
        # must not stall /health, nor another tenant's chat.
        try:
            return Response(await serving.text_pool.run(work, size, ctx.tenant_name), media_type="application/json")
        finally:
            await gateway.release(ctx)

    @router.post("/detokenize", response_model=None, responses=success(DetokenizeResponse))
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        ctx = await admit_text_work(request, body.model)
        vocab = tokenizer.vocab_size

        def work() -> dict[str, Any]:
            if any(not 0 <= t < vocab for t in body.tokens):
                raise APIError.bad_request(f"token ids must be in [0, {vocab})", param="tokens")
            return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

        try:
            return await serving.text_pool.run(work, len(body.tokens), ctx.tenant_name)  # as /tokenize
        finally:
            await gateway.release(ctx)

    return router
