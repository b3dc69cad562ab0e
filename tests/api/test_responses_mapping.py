"""The Responses API's pure mappings: input items onto chat messages, tools and formats onto the
chat request, parser pieces onto output items and stream events; and the response store."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenline.api.response_output import OutputBuilder
from tokenline.api.responses_protocol import ResponsesRequest, chat_tools, items_to_messages, response_format
from tokenline.frontend.chat_output import ChatPiece, ToolCallPiece
from tokenline.gateway.errors import APIError
from tokenline.gateway.response_store import ResponseStore, StoredResponse


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": "Done."},
    ]
    assert items_to_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "Done."},
    ]


@pytest.mark.parametrize(("items", "param"), [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ([{"role": "user"}], "input[0].content"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    (["hello"], "input[0]"),
])
def test_bad_items_name_their_place(items: list, param: str) -> None:
    with pytest.raises(APIError) as exc:
        items_to_messages(items)
    assert exc.value.status_code == 400 and exc.value.param == param


def test_stored_items_before_the_input_are_not_blamed_by_index() -> None:
    stored = [{"role": "user", "content": "earlier"}]
    with pytest.raises(APIError) as exc:
        items_to_messages([*stored, {"role": "user", "content": 3}], first_param_index=1)
    assert exc.value.param == "input[0].content"


def test_request_maps_onto_a_chat_request() -> None:
    request = ResponsesRequest(
        model="m", input="hi", instructions="sys", max_output_tokens=5, temperature=0.5, top_p=0.9,
        tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"}, reasoning={"effort": "low"},
        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
    )
    chat = request.to_chat(request.input_items())
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.max_completion_tokens == 5 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                             "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.reasoning_effort == "low"
    assert chat.response_format == {"type": "json_schema",
                                    "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": True}}
    assert chat.param_names["max_tokens"] == "max_output_tokens" and chat.param_names["prompt"] == "input"


def test_vllm_sampling_extensions_reach_the_chat_request() -> None:
    # What `vllm bench serve --backend openai-responses` sends (ignore_eos), and vLLM's other extras.
    request = ResponsesRequest(model="m", input="hi", ignore_eos=True, top_k=5, min_p=0.1, stop=["x"],
                               repetition_penalty=1.1, min_tokens=2)
    chat = request.to_chat(request.input_items())
    assert chat.ignore_eos is True and chat.top_k == 5 and chat.min_p == 0.1 and chat.stop == ["x"]
    assert chat.repetition_penalty == 1.1 and chat.min_tokens == 2
    unset = ResponsesRequest(model="m", input="hi").to_chat([{"role": "user", "content": "hi"}])
    assert unset.ignore_eos is False and unset.top_k is None and unset.frequency_penalty == 0.0
    with pytest.raises(APIError) as refused:
        ResponsesRequest(model="m", input="hi", top_k=-7).to_chat([{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 400 and refused.value.param == "top_k"


def test_tools_and_formats_are_checked() -> None:
    with pytest.raises(APIError) as exc:
        chat_tools([{"type": "web_search"}])
    assert exc.value.param == "tools[0].type"
    with pytest.raises(APIError) as exc:
        chat_tools([{"type": "function"}])
    assert exc.value.param == "tools[0].name"
    with pytest.raises(APIError) as exc:
        response_format({"type": "json_schema", "schema": {}})
    assert exc.value.param == "text.format.name"
    assert response_format({"type": "text"}) == {"type": "text"}


def test_builder_events_and_items() -> None:
    builder = OutputBuilder()
    events = builder.feed(ChatPiece(reasoning="think"))
    events += builder.feed(ChatPiece(reasoning=" more", content="Hi"))
    events += builder.feed(ChatPiece(tool_calls=[ToolCallPiece(0, "call_1", "f", ""), ToolCallPiece(0, arguments="{}")]))
    events += builder.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    reasoning, message, call = builder.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think more"}] and reasoning["summary"] == []
    assert message["content"][0]["text"] == "Hi" == builder.text and message["status"] == "completed"
    assert call == {"id": call["id"], "type": "function_call", "status": "completed", "call_id": "call_1",
                    "name": "f", "arguments": "{}"}
    added = events[0]["item"]
    assert added["status"] == "in_progress" and added["content"] == []  # a snapshot, not the live item


def test_an_empty_answer_still_has_its_message() -> None:
    builder = OutputBuilder()
    builder.finish("incomplete")
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in builder.items] == [("message", "incomplete", "")]


def test_response_store_is_per_tenant(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "usage.sqlite3")
    stored = StoredResponse("resp_1", "alice", {"id": "resp_1", "output": [{"type": "message"}]},
                            [{"role": "user", "content": "hi"}])
    store.put(stored)
    got = store.get("resp_1", "alice")
    assert got is not None and got.response == stored.response
    assert got.continued() == [{"role": "user", "content": "hi"}, {"type": "message"}]
    assert store.get("resp_1", "bob") is None
    assert not store.delete("resp_1", "bob") and store.delete("resp_1", "alice")
    assert store.get("resp_1", "alice") is None


def test_a_call_is_complete_even_when_the_answer_is_not() -> None:
    # Only whole calls reach the builder; the answer's status says the length limit came after.
    builder = OutputBuilder()
    builder.feed(ChatPiece(tool_calls=[ToolCallPiece(0, "call_1", "f", "{}")]))
    builder.finish("incomplete")
    assert [(i["type"], i["status"]) for i in builder.items] == [("function_call", "completed")]
    text = OutputBuilder()
    text.feed(ChatPiece(content="Hi"))
    text.finish("incomplete")
    assert [(i["type"], i["status"]) for i in text.items] == [("message", "incomplete")]
