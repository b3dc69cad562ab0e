"""``tokenline bench serve``: a light load client for any OpenAI-compatible server.

N random prompts of exactly I tokens (seeded, optionally sharing a P-token prefix) are streamed
through ``/v1/completions`` (as token-id arrays, so the input length is exact) or
``/v1/chat/completions`` (as decoded text, so it is approximate), with at most C requests in
flight. Per request it measures TTFT, inter-token latencies, TPOT and end-to-end latency, and the
report holds throughput and percentiles in the spirit of ``vllm bench serve``.

``workload="dataset"`` sends the prompts of a JSONL file instead (one ``{"prompt": "..."}`` a line,
as vLLM's custom dataset; text, so the input length is the server's count), and
``workload="multiturn"`` sends chats (``bench/multiturn.py``): groups sharing a system
prompt, conversations whose turns feed the model's answers back. Either way the report holds the
prefix-cache hit rate over the run, from the server's (or each replica's) ``/metrics``, and the
share of prompt tokens the responses' usage reported as cached.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenline.bench.prompts import load_tokenizer, make_prompts, ordinary_token_ids
from tokenline.bench.results import ENDPOINTS, BenchServeReport, RequestResult, cached_share, stats_ms

WORKLOADS = ("random", "multiturn", "dataset")


@dataclass
class BenchServeConfig:
    base_url: str
    concurrency: int = 1
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    seed: int = 0
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    endpoint: str = "completions"  # "completions" (exact input length) or "chat" (approximate)
    tokenizer_dir: str | None = None  # None: the default model's tokenizer
    shared_prefix_len: int = 0
    timeout: float = 600.0  # seconds, per request, from send to the end of the stream
    # Fields merged into every request body, e.g. {"response_format": {...}} to load a server with
    # structured output (as vLLM's bench client's --extra-body).
    extra_body: dict[str, Any] = field(default_factory=dict)
    # "random": num_prompts prompts of input_len; "multiturn": num_conversations chats of `turns`
    # turns over num_groups system prompts of system_prompt_len tokens, input_len per user message.
    workload: str = "random"
    num_groups: int = 4
    num_conversations: int = 16
    turns: int = 4
    system_prompt_len: int = 512
    # "dataset": a JSONL file of {"prompt": text}; num_prompts of them are sent, in file order
    # (cycling when the file has fewer).
    dataset_path: str | None = None
    # Where the prefix-cache counters are read: each replica's /metrics (base or full URL);
    # empty: the server's own, at base_url. metrics_api_key None: api_key.
    replica_metrics_urls: list[str] = field(default_factory=list)
    metrics_api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, not {self.endpoint!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {list(WORKLOADS)}, not {self.workload!r}")
        if self.workload == "multiturn":
            if self.endpoint != "chat":
                raise ValueError("the multiturn workload sends chat messages: use endpoint chat")
            if min(self.num_groups, self.num_conversations, self.turns, self.system_prompt_len) < 1:
                raise ValueError("num_groups, num_conversations, turns and system_prompt_len must be >= 1")
        if (self.workload == "dataset") != (self.dataset_path is not None):
            raise ValueError("the dataset workload needs a dataset path, and only it takes one")
        if self.concurrency < 1 or self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("concurrency, num_prompts, input_len and output_len must be >= 1")
        if not 0 <= self.shared_prefix_len <= self.input_len:
            raise ValueError("shared_prefix_len must be between 0 and input_len")
        if self.timeout <= 0:
            raise ValueError("timeout must be > 0")


def _has_text(data: str, key: str) -> bool:
    """Whether the JSON text ``data`` holds ``key`` (e.g. ``'"text":'``) with a non-empty string value.

    A cheap substring test instead of ``json.loads`` on every chunk: the client shares the CPU with
    the server it measures. A key can't match inside a string value, where its quotes are escaped,
    and ``""`` after the key can only be the empty string.
    """
    j = _value_at(data, key)
    return 0 <= j and j + 1 < len(data) and data[j] == '"' and data[j + 1] != '"'


def _value_at(data: str, key: str) -> int:
    """Where the value of ``key`` starts in the JSON text ``data`` (-1: no such key)."""
    i = data.find(key)
    if i < 0:
        return -1
    j = i + len(key)
    while j < len(data) and data[j] == " ":
        j += 1
    return j


def _carries_output(data: str, chat: bool) -> bool:
    """Whether a stream chunk brings generated output: text, or a token whose text the server holds
    back (half a character) and sends empty, as vLLM's client counts it. Not the chat role
    announcement, the usage chunk, or a closing chunk with nothing but its finish reason."""
    if not chat:
        return _has_text(data, '"text":') or ('"text":' in data and _unfinished(data))
    # Reasoning models stream their thinking first; it is output too (it costs decode steps).
    return (_has_text(data, '"content":') or _has_text(data, '"reasoning_content":')
            or _has_text(data, '"reasoning":') or ('"delta":' in data and '"role":' not in data and _unfinished(data)))


def _unfinished(data: str) -> bool:
    """Whether the chunk's choice has no finish reason yet (only asked of chunks without text)."""
    j = _value_at(data, '"finish_reason":')
    return j >= 0 and data.startswith("null", j)


async def _send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int,
                chat: bool, timeout: float, collect_text: bool = False) -> RequestResult:
    """One streamed request. ``collect_text``: keep the answer in ``result.text`` (costs a JSON
    decode per chunk, so only when the text is needed)."""
    result = RequestResult(prompt_len=prompt_len)
    content_chunks = 0
    finished = False
    start = time.perf_counter()
    last = start
    try:
        async with asyncio.timeout(timeout):  # per request, not per read: a trickling stream ends too
            async with client.stream("POST", url, json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread())[:200].decode("utf-8", "replace")
                    result.error = f"HTTP {response.status_code}: {body}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments, event: lines
                    now = time.perf_counter()
                    data = line[5:].strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    if _carries_output(data, chat):
                        if content_chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        content_chunks += 1
                        if collect_text:
                            for choice in json.loads(data).get("choices") or []:
                                part = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                                result.text += part or ""
                    # Full decode only for the rare chunks that need it: the final usage and errors.
                    if '"usage":{' in data or '"usage": {' in data or '"error":' in data:
                        obj = json.loads(data)
                        if obj.get("error"):
                            result.error = f"stream error: {json.dumps(obj['error'])[:200]}"
                            return result
                        usage = obj.get("usage")
                        if usage:
                            result.usage_reported = True
                            result.output_tokens = int(usage.get("completion_tokens") or 0)
                            if usage.get("prompt_tokens"):
                                result.prompt_len = int(usage["prompt_tokens"])
                            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                            if cached is not None:
                                result.cached_tokens = int(cached)
                            finished = True  # some servers end the stream after usage without [DONE]
    except TimeoutError:
        result.error = f"timeout after {timeout:g} s"
        return result
    except Exception as e:  # noqa: BLE001 - any broken request is counted as failed, never lost
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    if not finished:
        result.error = "stream ended before [DONE]"
        return result
    result.e2e = time.perf_counter() - start
    if not result.usage_reported:
        result.output_tokens = content_chunks
    result.success = True
    return result


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` s pass; its last answer (one more look at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class ServerNotReady(RuntimeError):
    """A server started for a benchmark exited, or did not answer ``/health`` in time."""


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout: float = 180.0,
                 interval: float = 0.5) -> None:
    """Poll ``url``/health until it answers 200. Raises ``ServerNotReady`` when ``process`` exits
    first or the time is up (callers add their log's tail)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=min(5.0, max(1.0, interval * 4))) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise ServerNotReady(f"the server at {url} exited ({process.returncode})")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerNotReady(f"the server at {url} was not healthy after {timeout:.0f} s")
            time.sleep(interval)


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def run_bench_serve(config: BenchServeConfig) -> BenchServeReport:
    """Send ``config.num_prompts`` streaming requests (or the multiturn workload's turns), at most
    ``config.concurrency`` at a time, and read the prefix-cache counters before and after."""
    from tokenline.bench.prefix_cache import (
        ScrapeError,
        hit_rates,
        scrape_prefix_counters,
    )

    tokenizer = load_tokenizer(config.tokenizer_dir)
    ordinary = ordinary_token_ids(tokenizer.vocab_size, tokenizer.all_special_ids)
    chat = config.endpoint == "chat"
    base_url = config.base_url.rstrip("/")
    url = base_url + ENDPOINTS[config.endpoint]
    metrics_urls = config.replica_metrics_urls or [base_url]
    metrics_key = config.metrics_api_key if config.metrics_api_key is not None else config.api_key

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # One connection per worker, so that no request waits for a connection instead of the server
    # (and one more for the /metrics scrapes).
    limits = httpx.Limits(max_connections=config.concurrency + 1, max_keepalive_connections=config.concurrency + 1)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(config.timeout)) as client:
        model = config.model or await _first_model(client, base_url)

        common: dict[str, Any] = {
            "model": model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": config.output_len,
            "ignore_eos": True,
            "temperature": 0,
            **config.extra_body,
        }
        note = ""
        try:
            before = await scrape_prefix_counters(client, metrics_urls, metrics_key)
        except ScrapeError as e:  # the load still runs: the usage-side share needs no scrape
            before, note = None, str(e)
        if config.workload == "multiturn":
            results, turns, duration, max_in_flight = await _run_multiturn(
                client, config, url, common, tokenizer, ordinary)
        else:
            results, duration, max_in_flight = await _run_random(client, config, url, common, chat, tokenizer, ordinary)
            turns = None
        after = None
        if before is not None:
            try:
                after = await scrape_prefix_counters(client, metrics_urls, metrics_key)
            except ScrapeError as e:
                note = str(e)

    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    report = BenchServeReport(
        base_url=base_url,
        endpoint=config.endpoint,
        model=model,
        concurrency=config.concurrency,
        num_prompts=len(results),
        input_len=config.input_len,
        output_len=config.output_len,
        seed=config.seed,
        shared_prefix_len=config.shared_prefix_len,
        input_len_exact=not chat and config.workload == "random",
        completed=len(ok),
        failed=len(failed),
        errors=dict(Counter(r.error for r in failed).most_common(10)),
        duration_s=duration,
        total_input_tokens=sum(r.prompt_len for r in ok),
        total_output_tokens=sum(r.output_tokens for r in ok),
        max_in_flight=max_in_flight,
        usage_reported=sum(r.usage_reported for r in ok),
        ttft_ms=stats_ms([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=stats_ms([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=stats_ms([x for r in ok for x in r.itl]),
        e2e_ms=stats_ms([r.e2e for r in ok]),
        workload=config.workload,
        prefix_cache_note=note,
    )
    if config.workload == "multiturn":
        report.num_groups, report.num_conversations = config.num_groups, config.num_conversations
        report.turns, report.system_prompt_len = config.turns, config.system_prompt_len
    if before is not None and after is not None:
        rate, queries, hits, replicas = hit_rates(before, after)
        report.prefix_cache_hit_rate = rate
        report.prefix_cache_queries, report.prefix_cache_hits = queries, hits
        report.prefix_cache_replicas = [asdict(r) for r in replicas]
    report.cached_prompt_tokens, report.cached_tokens_share = cached_share(ok)
    if turns is not None:
        report.cached_tokens_share_by_turn = [
            cached_share([r for r, t in zip(results, turns) if t == turn and r.success])[1]
            for turn in range(config.turns)
        ]
    return report


def load_dataset_prompts(path: str | Path, num_prompts: int) -> list[str]:
    """``num_prompts`` prompts from a JSONL file of ``{"prompt": text}`` lines, cycling through them."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line must be a JSON object with a string 'prompt'")
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


async def _run_random(client: httpx.AsyncClient, config: BenchServeConfig, url: str, common: dict[str, Any],
                      chat: bool, tokenizer: Any, ordinary: Sequence[int]) -> tuple[list[RequestResult], float, int]:
    """The random (or dataset) workload: results in prompt order, the duration and the most
    requests in flight."""
    payloads: list[dict[str, Any]] = []
    if config.dataset_path is not None:
        texts = load_dataset_prompts(config.dataset_path, config.num_prompts)
        # The client's count until the server's usage says (chat adds the template's tokens).
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        for text in texts:
            message = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
            payloads.append({**common, **message})
    else:
        prompts = make_prompts(config.num_prompts, config.input_len, ordinary, config.seed, config.shared_prefix_len)
        for ids in prompts:
            if chat:  # decoding and re-encoding random ids changes the count: the length is approximate
                payloads.append({**common, "messages": [{"role": "user", "content": tokenizer.decode(ids)}]})
            else:
                payloads.append({**common, "prompt": ids})

    results: list[RequestResult | None] = [None] * len(payloads)
    next_index = 0
    in_flight = max_in_flight = 0

    async def worker() -> None:
        nonlocal next_index, in_flight, max_in_flight
        # One event loop: taking the next index needs no lock.
        while next_index < len(payloads):
            i = next_index
            next_index += 1
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                results[i] = await _send(client, url, payloads[i], len(prompts[i]), chat, config.timeout)
            finally:
                in_flight -= 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(config.concurrency, len(payloads)))))
    duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration, max_in_flight


async def _run_multiturn(
    client: httpx.AsyncClient, config: BenchServeConfig, url: str, common: dict[str, Any], tokenizer: Any,
    ordinary: Sequence[int],
) -> tuple[list[RequestResult], list[int], float, int]:
    """The multiturn workload: results and their turn indexes, the duration, the most in flight."""
    from tokenline.bench.multiturn import (
        Conversation,
        Message,
        make_multiturn_workload,
        run_conversations,
    )

    workload = make_multiturn_workload(
        num_groups=config.num_groups, num_conversations=config.num_conversations, turns=config.turns,
        system_prompt_len=config.system_prompt_len, input_len=config.input_len, ordinary_ids=ordinary,
        decode=tokenizer.decode, seed=config.seed,
    )
    in_flight = max_in_flight = 0

    async def send(conversation: Conversation, turn: int, messages: list[Message]) -> RequestResult:
        nonlocal in_flight, max_in_flight
        payload = {**common, "messages": messages, "user": conversation.conversation_id}
        in_flight += 1
        max_in_flight = max(max_in_flight, in_flight)
        try:
            # prompt_len 0 until the server's usage says: the chat's token count is the server's.
            return await _send(client, url, payload, 0, True, config.timeout, collect_text=True)
        finally:
            in_flight -= 1

    start = time.perf_counter()
    turn_results = await run_conversations(workload, send, config.concurrency)
    duration = time.perf_counter() - start
    return [t.result for t in turn_results], [t.turn for t in turn_results], duration, max_in_flight
