"""The request processor on the default model's real tokenizer: one prompt check, parameters fitted
to the context, the ``n`` fan-out, and the output side (text, stop strings, usage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenline.engine.messages import EngineOutput, FinishReason, TokenLogprobs
from tokenline.frontend.processor import InputProcessor, PromptError
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.sampling_params import SamplingParams

CONTEXT = 64


@pytest.fixture(scope="module")
def processor(default_model_dir: Path) -> InputProcessor:
    return InputProcessor(Tokenizer.from_dir(default_model_dir), {"temperature": 0.2}, lambda: CONTEXT)


def test_one_prompt_check_with_one_message(processor: InputProcessor) -> None:
    with pytest.raises(PromptError, match="empty") as exc:
        processor.check_prompt([], "prompt")
    assert exc.value.param == "prompt"
    with pytest.raises(PromptError, match="out of range") as exc:
        processor.check_prompt([1, processor.tokenizer.vocab_size], "messages")
    assert exc.value.param == "messages"
    with pytest.raises(PromptError, match="maximum context length is 64") as exc:
        processor.check_prompt([1] * CONTEXT, "messages")
    assert exc.value.code == "context_length_exceeded"
    processor.check_prompt([1] * (CONTEXT - 1), "messages")  # room for one token


def test_max_tokens_fitted_to_the_context(processor: InputProcessor) -> None:
    assert processor.fit(SamplingParams(max_tokens=None), [0] * 10).max_tokens == CONTEXT - 10
    assert processor.fit(SamplingParams(max_tokens=54), [0] * 10).max_tokens == 54
    with pytest.raises(PromptError) as exc:
        processor.fit(SamplingParams(max_tokens=55), [0] * 10, {"max_tokens": "max_completion_tokens"})
    assert exc.value.param == "max_completion_tokens" and exc.value.code == "context_length_exceeded"
    # Filling max_tokens can break min_tokens: reported under the caller's name.
    with pytest.raises(PromptError) as exc:
        processor.fit(SamplingParams(max_tokens=None, min_tokens=60), [0] * 10)
    assert exc.value.param == "min_tokens"
    with pytest.raises(PromptError) as exc:
        processor.fit(SamplingParams(stop_token_ids=[10**9]), [0] * 10)
    assert exc.value.param == "stop_token_ids"
    with pytest.raises(PromptError) as exc:
        processor.fit(SamplingParams(logit_bias={10**9: 1.0}), [0] * 10)
    assert exc.value.param == "logit_bias"
    # resolve = fit + the model's generation config for what the caller left unset.
    resolved = processor.resolve(SamplingParams(max_tokens=4), [0] * 10)
    assert resolved.temperature == 0.2 and resolved.max_tokens == 4


def test_fan_out_makes_one_engine_request_per_prompt_and_choice(processor: InputProcessor) -> None:
    params = SamplingParams(n=2, seed=7, max_tokens=3)
    state = processor.fan_out("cmpl-x", [[1, 2, 3], [4, 5]], params, priority=3, client_request_id="rid")
    assert state.request_ids == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2", "cmpl-x-3"]
    assert [r.prompt_token_ids for r in state.engine_requests] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert [r.sampling.seed for r in state.engine_requests] == [7, 8, 7, 8]
    assert all(r.sampling.n == 1 and r.priority == 3 and r.client_request_id == "rid" for r in state.engine_requests)
    assert [s.prompt_index for s in state.in_order()] == [0, 0, 1, 1]


def test_output_side_text_stop_strings_and_usage(processor: InputProcessor) -> None:
    tokenizer = processor.tokenizer
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    state = processor.fan_out("g", [[1, 2, 3]], SamplingParams(n=2, max_tokens=10, stop=[" three"]))
    first, second = state.request_ids
    logprobs = [TokenLogprobs(-0.5) for _ in ids]
    # A speculative step brings every token at once: the text and the ids end at the stop string.
    update = state.absorb(EngineOutput(first, list(ids), logprobs, num_output_tokens=len(ids), num_cached_tokens=2), 1.0)
    assert update.text == " one two" and update.abort and update.seq.finish_reason == "stop"
    assert len(update.seq.token_ids) == len(update.logprobs) == update.num_new_tokens < len(ids)
    assert update.seq.stop_reason == " three" and not state.finished
    assert state.running_in_engine() == [first, second]
    # The engine's final word after the abort: billed, not shown.
    state.absorb_final(EngineOutput(first, [], finish_reason=FinishReason.ABORT, num_output_tokens=len(ids)))
    assert state.running_in_engine() == [second]
    late = state.absorb(EngineOutput(second, ids[:1], finish_reason=FinishReason.LENGTH, num_output_tokens=1), 2.0)
    assert late.text == " one" and late.seq.finish_reason == "length" and not late.abort
    assert state.finished
    usage = state.usage()
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (3, 2, len(ids) + 1)


def test_a_filter_cut_takes_back_the_tokens_of_the_cut_text(processor: InputProcessor) -> None:
    tokenizer = processor.tokenizer
    text = " The xylophone is here, \U0001F3B5 and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for cut in (len(" The"), len(" The xyl"), len(" The xylophone is here, "), len(text) - 2):
        state = processor.fan_out("g", [[1, 2, 3]], SamplingParams(max_tokens=50, logprobs=0))
        [rid] = state.request_ids
        state.absorb(EngineOutput(rid, list(ids), [TokenLogprobs(-0.1) for _ in ids], num_output_tokens=len(ids)))
        seq = state.sequences[rid]
        seq.cut(cut, "house-words")
        shown = tokenizer.decode(seq.token_ids)
        # Only tokens wholly before the cut: none that spells (part of) what was cut.
        assert text[:cut].startswith(shown) and len(shown) > cut - 8, (cut, shown)
        assert "\ufffd" not in shown and len(seq.logprobs) == len(seq.token_ids)
        assert seq.stream.text == text[:cut] and seq.finish_reason == "content_filter"
        assert state.usage().completion_tokens == len(ids)  # what the engine produced is still billed


def test_a_filtered_stream_holds_text_back_and_shows_only_tokens_within_it(processor: InputProcessor) -> None:
    tokenizer = processor.tokenizer
    text = " The sky is a beautiful shade of blue \U0001F3B5 today"
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = processor.fan_out("g", [[1, 2, 3]], SamplingParams(max_tokens=50, logprobs=0))
    [rid] = state.request_ids
    seq = state.sequences[rid]
    shown_text, shown_ids = "", []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        state.absorb(EngineOutput(rid, [token_id], [TokenLogprobs(-0.1)], num_output_tokens=i + 1,
                                  finish_reason=FinishReason.LENGTH if last else None))
        delta, new_ids, logprobs = seq.release(12)
        shown_text += delta
        shown_ids += new_ids
        assert len(logprobs) == len(new_ids)
        if not last:
            assert len(shown_text) == max(0, len(seq.stream.text) - 12)  # the last 12 characters wait
            assert shown_text.startswith(tokenizer.decode(shown_ids))  # ids never run ahead of the text
    assert shown_text == text and shown_ids == ids  # everything once the text ended


def test_a_constraint_is_validated_and_starts_after_the_reasoning(
    processor: InputProcessor, qwen_tokenizer_dir: Path
) -> None:
    from tokenline.sampling_params import StructuredOutputs

    with pytest.raises(PromptError) as exc:
        processor.fit(SamplingParams(structured_outputs=StructuredOutputs(regex="[a-")), [0] * 10)
    assert exc.value.param == "structured_outputs.regex"
    with pytest.raises(PromptError) as exc:  # the caller's name for the field
        processor.fit(SamplingParams(structured_outputs=StructuredOutputs(json={"type": "objectx"})), [0] * 10,
                      {"structured_outputs.json": "response_format.json_schema.schema"})
    assert exc.value.param == "response_format.json_schema.schema"
    qwen = Tokenizer.from_dir(qwen_tokenizer_dir)
    thinking = InputProcessor(qwen, {}, lambda: CONTEXT, reasoning=True)
    spec = StructuredOutputs(json_object=True)
    opened = qwen.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = qwen.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    fitted = thinking.fit(SamplingParams(structured_outputs=spec), opened).structured_outputs
    assert fitted is not None and fitted.start_after_token_id == qwen.token_to_id("</think>")
    assert thinking.fit(SamplingParams(structured_outputs=spec), closed).structured_outputs == spec
    # Without a reasoning parser the answer is constrained from its first token.
    assert processor.fit(SamplingParams(structured_outputs=spec), [0] * 10).structured_outputs == spec


def test_omitted_max_tokens_is_capped(processor: InputProcessor) -> None:
    # --max-tokens-cap: the gateway refuses an explicit max_tokens above it; an omitted one gets it.
    assert processor.fit(SamplingParams(max_tokens=None), [0] * 10, max_tokens_cap=5).max_tokens == 5
    assert processor.fit(SamplingParams(max_tokens=None), [0] * 60, max_tokens_cap=5).max_tokens == CONTEXT - 60
    assert processor.fit(SamplingParams(max_tokens=3), [0] * 10, max_tokens_cap=5).max_tokens == 3
    assert processor.resolve(SamplingParams(max_tokens=None), [0] * 10, max_tokens_cap=5).max_tokens == 5
    # A protocol default (completions' 16) is cut to the cap too, before the context check.
    assert processor.fit(SamplingParams(max_tokens=16), [0] * 50, max_tokens_cap=5).max_tokens == 5
