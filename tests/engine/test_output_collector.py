"""The API side's per-request output buffer: a slow consumer holds tokens, not records."""

from __future__ import annotations

import asyncio

import pytest

from tokenline.engine.client import EngineDeadError, OutputCollector
from tokenline.engine.messages import EngineOutput, FinishReason, TokenLogprobs


def test_outputs_merge_while_the_consumer_is_away() -> None:
    async def scenario() -> None:
        collector = OutputCollector(["a", "b"])
        for i in range(1000):
            collector.put(EngineOutput("a", [i], [TokenLogprobs(-0.5)], num_output_tokens=i + 1))
        collector.put(EngineOutput("b", [7]))
        # One pending record per request however many steps passed: memory follows tokens only.
        assert len(collector._pending) == 2
        assert collector.backlog_tokens() == 1001
        outputs = {o.request_id: o for o in await collector.get()}
        assert outputs["a"].new_token_ids == list(range(1000))
        assert len(outputs["a"].new_logprobs) == 1000 and outputs["a"].num_output_tokens == 1000
        assert collector.backlog_tokens() == 0 and not collector.finished
        collector.put(EngineOutput("a", [5], finish_reason=FinishReason.LENGTH))
        collector.put(EngineOutput("b", [], finish_reason=FinishReason.ABORT))
        await collector.get()
        assert collector.finished

    asyncio.run(scenario())


def test_a_failure_reaches_the_waiting_consumer() -> None:
    async def scenario() -> None:
        collector = OutputCollector(["a"])
        waiter = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)
        collector.fail(EngineDeadError("engine exited"))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 1)

    asyncio.run(scenario())


def test_prompt_logprobs_survive_a_merge() -> None:
    async def scenario() -> None:
        collector = OutputCollector(["a"])
        scores = [None, TokenLogprobs(-1.0, rank=2)]
        collector.put(EngineOutput("a", [3], prompt_logprobs=scores))  # only the first output has them
        collector.put(EngineOutput("a", [4]))
        (merged,) = await collector.get()
        assert merged.new_token_ids == [3, 4] and merged.prompt_logprobs == scores

    asyncio.run(scenario())
