"""The engine's side of structured output with a model-free runner and a real compiler: a request
waits for its grammar without holding up others, can be aborted while it waits, fails cleanly
(with the field named, no tokens, nothing leaked) when its grammar does not compile or takes too
long, and the engine never spins or hangs on it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.engine.fake_runner import FakeRunner
from tokenline.engine.engine_core import EngineCore, RequestRejected
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest, FinishReason
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.sampling_params import SamplingParams, StructuredOutputs
from tokenline.structured_output.grammar import CompiledGrammar, GrammarCompiler

EOS = 2


class GatedCompiler(GrammarCompiler):
    """Compiles only once ``gate`` is set."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        self.gate.wait(timeout=60)
        return super().compile(spec)


@pytest.fixture
def compiler(default_model_dir: Path) -> GatedCompiler:
    compiler = GatedCompiler(default_model_dir / "tokenizer.json", 49152, [EOS])
    yield compiler
    compiler.gate.set()
    compiler.shutdown()


def make_engine(compiler: GrammarCompiler | None, timeout_s: float = 10.0) -> EngineCore:
    return EngineCore(
        FakeRunner(vocab=49152),
        KVCacheManager(64, 4, True),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        eos_token_ids=[EOS],
        check_integrity_every_step=True,
        grammar_compiler=compiler,
        grammar_compile_timeout_s=timeout_s,
    )


def request(request_id: str, spec: StructuredOutputs | None = None, max_tokens: int = 4) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)
    return EngineRequest(request_id, [10, 11, 12], params.with_defaults())


def test_waits_for_its_grammar_without_blocking_others_and_aborts_cleanly(compiler: GatedCompiler) -> None:
    engine = make_engine(compiler)
    engine.add_request(request("constrained", StructuredOutputs(choice=["yes", "no"])))
    engine.add_request(request("plain"))
    finished = {}
    for _ in range(20):
        for output in engine.step():
            assert output.request_id == "plain"
            if output.finished:
                finished[output.request_id] = output
    assert "plain" in finished  # ran to the end while the grammar was still compiling
    assert engine.scheduler.num_waiting == 1 and engine.has_unfinished_requests()
    aborted = engine.abort_request("constrained")
    assert aborted is not None and aborted.finish_reason == FinishReason.ABORT and aborted.new_token_ids == []
    assert not engine.has_unfinished_requests()
    compiler.gate.set()
    assert engine.step() == [] and engine.take_failed_requests() == []
    engine.scheduler.check_integrity()
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks


def test_compile_past_the_bound_fails_the_request(compiler: GatedCompiler) -> None:
    engine = make_engine(compiler, timeout_s=0.05)
    engine.add_request(request("slow", StructuredOutputs(regex="[a-z]+")))
    for _ in range(200):
        assert engine.step() == []  # waits a little per step: no busy spin, never scheduled
        failed = engine.take_failed_requests()
        if failed:
            break
    assert [(f.request_id, f.param) for f in failed] == [("slow", "structured_outputs")]
    assert "did not compile within" in failed[0].message
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()


def test_grammar_that_does_not_compile_fails_with_its_field(default_model_dir: Path) -> None:
    compiler = GrammarCompiler(default_model_dir / "tokenizer.json", 49152, [EOS])
    engine = make_engine(compiler)
    engine.add_request(request("bad", StructuredOutputs(grammar="start: nowhere")))
    engine.add_request(request("good"))
    failed = []
    for _ in range(50):
        engine.step()
        failed += engine.take_failed_requests()
        if not engine.has_unfinished_requests():
            break
    assert [(f.request_id, f.param) for f in failed] == [("bad", "structured_outputs.grammar")]
    assert not engine.has_unfinished_requests()
    compiler.shutdown()


def test_no_compiler_rejects_structured_requests() -> None:
    engine = make_engine(None)
    with pytest.raises(RequestRejected) as info:
        engine.add_request(request("x", StructuredOutputs(choice=["a"])))
    assert info.value.param == "structured_outputs"


def test_engine_process_fails_a_bad_grammar_with_its_field(default_model_dir: Path) -> None:
    """Through a real engine process: the failed compilation reaches the request's collector as an
    EngineRequestError naming the field; a good constrained request beside it finishes with "stop"."""
    import asyncio

    from tokenline.engine.client import EngineRequestError
    from tokenline.engine.config import EngineConfig
    from tokenline.engine.process_client import EngineProcessClient
    from tokenline.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(default_model_dir)

    async def run() -> tuple[EngineRequestError, list[int], FinishReason | None]:
        client = EngineProcessClient(EngineConfig(num_kv_blocks=64, dtype="float32"), default_model_dir)
        client.start()
        try:
            await client.wait_ready(timeout=120)
            bad = client.add([request("bad", StructuredOutputs(grammar="start: nowhere"))])
            with pytest.raises(EngineRequestError) as info:
                await asyncio.wait_for(bad.get(), timeout=60)
            good = client.add([request("good", StructuredOutputs(choice=["red", "green"]), max_tokens=10)])
            tokens: list[int] = []
            finish = None
            while not good.finished:
                for output in await asyncio.wait_for(good.get(), timeout=60):
                    tokens.extend(output.new_token_ids)
                    finish = output.finish_reason
            return info.value, tokens, finish
        finally:
            await client.shutdown()

    error, tokens, finish = asyncio.run(run())
    assert error.param == "structured_outputs.grammar" and "nowhere" in str(error)
    assert tokenizer.decode(tokens) in ("red", "green") and finish == FinishReason.STOP
