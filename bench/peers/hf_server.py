#!/usr/bin/env python3
"""An OpenAI ``/v1/completions`` server on HF transformers' continuous batching, for the peers harness.

``transformers serve --continuous-batching`` would be the first choice, but it refuses what both
benchmark clients send: ``ignore_eos`` (422, "Unexpected fields in the request") and token-id prompts
(400, "prompt must be a string"). This file is only the HTTP layer around what ``transformers serve``
drives: ``model.init_continuous_batching()`` and its ``ContinuousBatchingManager`` (scheduler, paged
cache, batched forward passes, all transformers'), one ``add_request`` per HTTP request, outputs
delivered through ``register_result_handler`` as ``transformers serve``'s ``CBGenerateManager`` does.

``--mode generate`` serves one request at a time through ``model.generate`` instead: what
``transformers serve`` falls back to for a model its continuous batching cannot run. Greedy only
(the harness sends temperature 0).

Run with tokenline's venv python (torch, transformers, fastapi, uvicorn), 127.0.0.1 only:

    .venv/bin/python bench/peers/hf_server.py MODEL_DIR --port 8000 [--mode cb|generate] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.streamers import BaseStreamer

WARMUP_TIMEOUT_S = 600.0
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Completion:
    """One parsed request: the prompt's token ids and what to generate."""

    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    include_usage: bool


class BadRequest(ValueError):
    pass


def parse_request(body: Any, tokenizer: Any, vocab_size: int) -> Completion:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("'prompt' must be a string or a non-empty list of token ids (one prompt)")
    if not ids:
        raise BadRequest("the prompt is empty")
    if max(ids) >= vocab_size or min(ids) < 0:
        raise BadRequest("a prompt token id is outside the vocabulary")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("'max_tokens' must be an integer >= 1")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is served")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise BadRequest("only greedy decoding (temperature 0) is served")
    options = body.get("stream_options") or {}
    return Completion(ids, max_tokens, bool(body.get("stream")), bool(body.get("ignore_eos")),
                      bool(options.get("include_usage", True)))


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=status)


class TokenQueue(BaseStreamer):
    """``generate``'s streamer: the new token ids onto an asyncio queue, ``None`` at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands over the prompt first
            self.prompt_seen = True
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class Engine:
    """The model, its tokenizer, and transformers' generation behind it (continuous batching or not)."""

    def __init__(self, model_dir: str, mode: str, max_batch_tokens: int | None, kv_cache_gib: float) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        self.mode = mode
        eos = self.model.generation_config.eos_token_id
        self.eos: list[int] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.lock = threading.Lock()  # generate mode: one request at a time
        self.manager = None
        if mode == "cb":
            from transformers import ContinuousBatchingConfig

            config = GenerationConfig(do_sample=False, max_new_tokens=DEFAULT_MAX_TOKENS,
                                      eos_token_id=self.eos or None)
            # On CPU transformers sizes the paged cache as a share of the machine's RAM (60-90 %): bound it
            # like vLLM's VLLM_CPU_KVCACHE_SPACE instead, as a share of what is left after the model.
            import psutil

            left = psutil.virtual_memory().total - psutil.Process().memory_info().rss
            cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens,
                                                 max_memory_percent=min(0.9, kv_cache_gib * 2**30 / left))
            self.manager = self.model.init_continuous_batching(generation_config=config,
                                                               continuous_batching_config=cb_config)
            self.manager.start()

    def warm_up(self) -> None:
        """One short request before /health answers: a model continuous batching cannot run fails here,
        at start-up, with transformers' own error."""
        ids = self.tokenizer("Hello, world", add_special_tokens=True)["input_ids"]
        if self.manager is None:
            with torch.inference_mode():
                self.model.generate(torch.tensor([ids]), generation_config=self._generate_config(2, True))
            return
        rid = self.manager.add_request(ids, request_id="warm-up", max_new_tokens=2, eos_token_id=-1)
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while time.monotonic() < deadline:
            fatal = self.manager.background_thread_status.fatal_error
            if fatal is not None:
                raise RuntimeError(f"transformers' continuous batching failed: {fatal!r}")
            out = self.manager.get_result(request_id=rid, timeout=1.0)
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed: {out.error}")
                return
        raise RuntimeError(f"warm-up request unanswered after {WARMUP_TIMEOUT_S:.0f} s")

    def _generate_config(self, max_tokens: int, ignore_eos: bool) -> GenerationConfig:
        return GenerationConfig(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=0,
                                eos_token_id=None if ignore_eos else (self.eos or None),
                                pad_token_id=self.tokenizer.pad_token_id)

    async def tokens(self, req: Completion) -> AsyncIterator[list[int]]:
        """The generated token ids as they come, a list per step."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        if self.manager is not None:
            rid = uuid.uuid4().hex
            seen = 0

            def on_output(output: Any) -> None:
                nonlocal seen
                if output.error is not None:
                    queue.put_nowait(RuntimeError(output.error))
                    return
                new = output.generated_tokens[seen:]
                seen = len(output.generated_tokens)
                if new:
                    queue.put_nowait(list(new))
                if output.is_finished():
                    queue.put_nowait(None)

            self.manager.register_result_handler(rid, on_output)  # before add_request: no lost output
            self.manager.add_request(req.prompt_ids, request_id=rid, max_new_tokens=req.max_tokens, streaming=True,
                                     eos_token_id=-1 if req.ignore_eos else (self.eos or -1))
        else:
            streamer = TokenQueue(loop, queue)
            config = self._generate_config(req.max_tokens, req.ignore_eos)

            def run() -> None:
                with self.lock, torch.inference_mode():
                    try:
                        self.model.generate(torch.tensor([req.prompt_ids]), generation_config=config,
                                            streamer=streamer)
                    except Exception as e:  # noqa: BLE001 - handed to the request, not swallowed
                        loop.call_soon_threadsafe(queue.put_nowait, e)

            threading.Thread(target=run, daemon=True).start()
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item


def build_app(engine: Engine, model_name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "root": model_name,
                                            "owned_by": "transformers"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            vocab_size = engine.model.config.get_text_config().vocab_size
            req = parse_request(await request.json(), engine.tokenizer, vocab_size)
        except json.JSONDecodeError:
            return error(400, "the body is not valid JSON")
        except BadRequest as e:
            return error(400, str(e))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n_prompt = len(req.prompt_ids)

        def chunk(text: str, finish: str | None, usage: dict[str, int] | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                    "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                                 "logprobs": None}]}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def usage_of(n: int) -> dict[str, int]:
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        def finish_of(ids: list[int]) -> str:
            return "length" if len(ids) >= req.max_tokens else "stop"

        if req.stream:
            async def events() -> AsyncIterator[str]:
                ids: list[int] = []
                try:
                    async for new in engine.tokens(req):
                        ids += new
                        yield chunk(engine.tokenizer.decode(new), None)
                except Exception as e:  # noqa: BLE001 - the stream has started: report in band
                    yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
                    return
                yield chunk("", finish_of(ids), usage_of(len(ids)) if req.include_usage else None)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        ids = []
        try:
            async for new in engine.tokens(req):
                ids += new
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"error": {"message": str(e), "type": "server_error", "param": None,
                                           "code": None}}, status_code=503)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": [{"index": 0, "text": engine.tokenizer.decode(ids),
                                          "finish_reason": finish_of(ids), "logprobs": None}],
                             "usage": usage_of(len(ids))})

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF-format model directory")
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1")
    p.add_argument("--mode", choices=["cb", "generate"], default="cb",
                   help="cb: transformers' continuous batching; generate: one request at a time via model.generate")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-batch-tokens", type=int, default=1024,
                   help="continuous batching: tokens per forward pass (default 1024; transformers' own choice on "
                        "CPU, 8192, sizes its float32 logits buffer past a few GiB of cache)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0,
                   help="continuous batching: GiB for the paged KV cache (default 4, as compare.py gives vLLM)")
    p.add_argument("--served-model-name", default=None, help="the id /v1/models lists (default: the directory)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(args.model, args.mode, args.max_batch_tokens, args.kv_cache_gib)
    try:
        engine.warm_up()
    except Exception as e:  # noqa: BLE001 - the error is the result: printed, then exit 1
        print(f"hf_server: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # the manager's generation thread is not a daemon: don't wait on it
    print(f"hf_server: {args.model} ready ({args.mode})", flush=True)
    uvicorn.run(build_app(engine, args.served_model_name or args.model), host="127.0.0.1", port=args.port,
                log_level="warning")
    if engine.manager is not None:
        engine.manager.stop(block=True, timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
