"""``EngineProcessClient`` against a real engine process on the default model: outputs reach the
request's collector, and every step's record and KV events reach the client's step listeners
(what a live page, a simulator fit or an in-process router consumes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tokenline.engine.config import EngineConfig
from tokenline.engine.kv_events import BlockStored, CachedBlockIndex
from tokenline.engine.messages import EngineRequest, StepOutputs
from tokenline.engine.process_client import EngineProcessClient
from tokenline.sampling_params import SamplingParams


def test_outputs_records_and_events_reach_their_consumers(default_model_dir: Path) -> None:
    prompt = [2000 + i for i in range(40)]  # two full blocks of 16, and a partial one
    steps: list[StepOutputs] = []

    async def run() -> list[int]:
        config = EngineConfig(num_kv_blocks=64, dtype="float32", enable_kv_cache_events=True)
        client = EngineProcessClient(config, default_model_dir)
        client.add_step_listener(steps.append)
        client.start()
        try:
            info = await client.wait_ready(timeout=120)
            assert info.block_size == 16 and client.ready and client.alive
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True).with_defaults()
            collector = client.add([EngineRequest("r-0", prompt, params, client_request_id="caller-1")])
            tokens: list[int] = []
            while not collector.finished:
                for output in await asyncio.wait_for(collector.get(), timeout=60):
                    tokens.extend(output.new_token_ids)
            assert client.num_inflight == 0
            client.forget(collector)
            return tokens
        finally:
            await client.shutdown()

    tokens = asyncio.run(run())
    assert len(tokens) == 5
    records = [r for step in steps for r in step.step_records]
    assert sum(r.num_prefill_tokens for r in records) == len(prompt)
    assert sum(r.num_decode_tokens for r in records) == len(tokens) - 1  # the first comes with the prefill
    assert [r.step for r in records] == sorted(r.step for r in records)
    index = CachedBlockIndex()
    index.apply(e for step in steps for e in step.kv_events)
    assert len(index) == 2 and any(isinstance(e, BlockStored) for step in steps for e in step.kv_events)
