"""Real agent frameworks against a real tokenline server: each one's tool loop, end to end.

openai-agents (on its Chat Completions and its Responses model), LangChain's ``bind_tools``,
pydantic-ai, instructor (``TOOLS`` and ``JSON_SCHEMA``) and litellm, pinned in the ``test`` extra,
run against the default model (SmolLM2-135M, hermes tool calls) and the tiny Qwen3.5 hybrid
(random weights, qwen3 parsers). The first turn forces the call (``tool_choice`` required or
named): the test checks the server's part (the call parses as the framework expects, its arguments
follow the tool's schema, the conversation with the tool's result renders and is answered), not
the 135M model's wit. Tool arguments are enums or bounded strings so that even random weights end
every call. Nothing may leave the machine: tracing and telemetry are off, and a guard fails any
test in which a framework connects (or resolves a name) beyond the loopback."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import agents
import instructor
import openai
import pydantic_ai
import pytest
from agents import ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, RunContextWrapper
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai.types.shared import Reasoning
from pydantic import BaseModel, Field
from pydantic_ai import RunContext
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIChatModelSettings
from pydantic_ai.providers.openai import OpenAIProvider

from tests.conftest import TinyQwen3_5
from tests.e2e.conftest import Server, start_server

# Read by the frameworks at import or call time: no price list fetched, no traces exported, no hub.
OFFLINE_ENV = {
    "LITELLM_OFFLINE_MODE": "true",
    "LITELLM_LOCAL_MODEL_COST_MAP": "true",
    "OPENAI_AGENTS_DISABLE_TRACING": "true",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "HF_HUB_OFFLINE": "1",
}
CITIES = ("Paris", "Tokyo", "Lima")
City = Literal["Paris", "Tokyo", "Lima"]
WEATHER = "sunny, 21 C"
QUESTION = "What is the weather in Paris? Use the tool."
CALL_TOKENS = 40  # room for one forced call of get_weather on either model (27 tokens on SmolLM2)
ANSWER_TOKENS = 8  # the answer after the tool's result: any text will do


@dataclass
class Served:
    """A served model and the name the frameworks ask for."""

    server: Server
    model: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.api_url, api_key="none", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.server.api_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["smollm2", "qwen3_5_tiny"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           default_model_dir: Path) -> Iterator[Served]:
    """One server per model for the whole module (pytest runs all tests of one model, then the other)."""
    if request.param == "smollm2":
        args: tuple[str, ...] = (str(default_model_dir), "--tool-call-parser", "hermes")
    else:
        tiny: TinyQwen3_5 = request.getfixturevalue("tiny_qwen3_5")
        args = (str(tiny()), "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3")
    with start_server(tmp_path_factory.mktemp(f"agents-{request.param}"), *args,
                      "--served-model-name", request.param) as server:
        yield Served(server, request.param)


def _is_loopback(host: object) -> bool:
    if not isinstance(host, (str, bytes)):
        return True  # a unix socket path or a raw address family we do not police
    host = host.decode() if isinstance(host, bytes) else host
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name: resolving it already means the network


@pytest.fixture(scope="module", autouse=True)
def offline_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE_ENV.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if anything in this process reaches past the loopback (frameworks swallow
    their telemetry errors, so a refused connection alone would go unnoticed)."""
    attempts: list[str] = []
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def guard(where: str, host: object) -> None:
        if not _is_loopback(host):
            attempts.append(f"{where} {host!r}")
            raise OSError(f"tests/e2e/test_agent_frameworks.py: no network ({where} {host!r})")

    def guarded_connect(sock: socket.socket, address: object) -> None:
        guard("connect", address[0] if isinstance(address, tuple) else address)
        return connect(sock, address)

    def guarded_connect_ex(sock: socket.socket, address: object) -> int:
        guard("connect", address[0] if isinstance(address, tuple) else address)
        return connect_ex(sock, address)

    def guarded_getaddrinfo(host: object, *args: object, **kwargs: object) -> list:
        guard("resolve", host)
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    yield
    assert not attempts, f"a framework reached for the network: {attempts}"


@dataclass
class WeatherCalls:
    """What the tool was asked, for the test to check after the run."""

    cities: list[str] = field(default_factory=list)

    def weather(self, city: str) -> str:
        assert city in CITIES, city  # the forced call's arguments follow the tool's enum
        self.cities.append(city)
        return WEATHER


# --- openai-agents ------------------------------------------------------------------------------

class Report(BaseModel):
    summary: str = Field(max_length=16)


@pytest.mark.parametrize("path", ["chat_completions", "responses"])
def test_openai_agents_tool_round_trip(served: Served, path: str) -> None:
    """A function tool forced on the first turn (``tool_choice="required"``, one call at a time), its
    result fed back, a final answer. On the Responses path the answer is a structured ``Report``:
    openai-agents raises on an ``incomplete`` response, and the random-weight model never stops by
    itself, so the answer's schema must end it (the forced first turn then carries the output
    schema too, as openai-agents always sends it)."""
    calls = WeatherCalls()

    def not_yet_called(ctx: RunContextWrapper[WeatherCalls], agent: object) -> bool:
        # The tool answers once: the turn after its result has no tools, so the model answers in text.
        return not ctx.context.cities

    @agents.function_tool(is_enabled=not_yet_called, failure_error_function=None)
    def get_weather(ctx: RunContextWrapper[WeatherCalls], city: City) -> str:
        """The weather in a city."""
        return ctx.context.weather(city)

    model_class = OpenAIChatCompletionsModel if path == "chat_completions" else OpenAIResponsesModel
    agent = agents.Agent[WeatherCalls](
        name="weather",
        output_type=str if path == "chat_completions" else Report,
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=model_class(model=served.model, openai_client=served.async_client()),
        model_settings=ModelSettings(
            # One max_tokens for every turn: the call's, which also bounds the answer.
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=CALL_TOKENS,
            reasoning=Reasoning(effort="none"),  # the Qwen3.5 template's thinking off; SmolLM2 has none
        ),
    )
    result = agents.Runner.run_sync(agent, QUESTION, context=calls, max_turns=3,
                                    run_config=RunConfig(tracing_disabled=True))

    assert calls.cities and len(calls.cities) == 1, calls.cities
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    assert result.new_items[1].output == WEATHER
    if path == "chat_completions":
        assert isinstance(result.final_output, str) and result.final_output
    else:
        assert isinstance(result.final_output, Report)
    assert len(result.raw_responses) == 2  # the call, then the answer to its result


# --- LangChain ----------------------------------------------------------------------------------

def test_langchain_bind_tools_loop_with_a_tool_message(served: Served) -> None:
    calls = WeatherCalls()

    @tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        return calls.weather(city)

    llm = ChatOpenAI(model=served.model, base_url=served.server.api_url, api_key="none", temperature=0,
                     max_tokens=CALL_TOKENS, max_retries=0, timeout=120, reasoning_effort="none")
    messages = [HumanMessage(QUESTION)]
    called = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(messages)
    assert isinstance(called, AIMessage) and len(called.tool_calls) == 1, called
    assert called.tool_calls[0]["name"] == "get_weather" and set(called.tool_calls[0]["args"]) == {"city"}
    tool_message = get_weather.invoke(called.tool_calls[0])  # a ToolCall in, a ToolMessage out
    assert isinstance(tool_message, ToolMessage) and tool_message.content == WEATHER
    messages += [called, tool_message]

    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(messages, max_tokens=ANSWER_TOKENS)
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert isinstance(answer.content, str) and answer.content
    assert calls.cities == [called.tool_calls[0]["args"]["city"]]


# --- pydantic-ai --------------------------------------------------------------------------------

def test_pydantic_ai_agent_with_a_tool(served: Served) -> None:
    calls = WeatherCalls()

    def settings(ctx: RunContext[None]) -> OpenAIChatModelSettings:
        # Forced on the first request (pydantic-ai sends "required", the tool being the only one),
        # none after the tool's result: the run ends in text.
        return OpenAIChatModelSettings(
            tool_choice=["get_weather"] if ctx.run_step <= 1 else "none", parallel_tool_calls=False,
            temperature=0, max_tokens=CALL_TOKENS if ctx.run_step <= 1 else ANSWER_TOKENS,
            openai_reasoning_effort="none",
        )

    model = OpenAIChatModel(served.model, provider=OpenAIProvider(openai_client=served.async_client()))
    agent = pydantic_ai.Agent(model, instructions="Answer with the weather tool.", model_settings=settings,
                              output_type=str)

    @agent.tool_plain
    def get_weather(city: City) -> str:
        """The weather in a city."""
        return calls.weather(city)

    result = agent.run_sync(QUESTION)

    assert len(calls.cities) == 1, calls.cities
    parts = [part for message in result.all_messages() for part in message.parts]
    assert [p.tool_name for p in parts if isinstance(p, ToolCallPart)] == ["get_weather"]
    assert [p.content for p in parts if isinstance(p, ToolReturnPart)] == [WEATHER]
    assert isinstance(result.output, str) and result.output


# --- instructor ---------------------------------------------------------------------------------

class Seat(BaseModel):
    row: int = Field(ge=1, le=30)
    letter: Literal["A", "B", "C", "D"]


class Booking(BaseModel):
    """A nested model: its schema refers to Seat through $defs."""

    passenger: str = Field(min_length=1, max_length=12)
    seats: list[Seat] = Field(min_length=1, max_length=2)


@pytest.mark.parametrize("mode_name", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_nested_model(served: Served, mode_name: str) -> None:
    mode = instructor.Mode[mode_name]
    assert "$defs" in Booking.model_json_schema()
    client = instructor.from_openai(served.client(), mode=mode)
    booking, completion = client.chat.completions.create_with_completion(
        model=served.model, response_model=Booking, max_retries=1, temperature=0, max_tokens=96,
        reasoning_effort="none",
        messages=[{"role": "user", "content": "Book seats 12A and 12B for Ada."}],
    )
    assert isinstance(booking, Booking) and all(isinstance(seat, Seat) for seat in booking.seats)
    choice = completion.choices[0]
    if mode is instructor.Mode.TOOLS:
        # instructor names its tool in tool_choice: exactly one call of it, nothing else.
        assert [call.function.name for call in choice.message.tool_calls] == ["Booking"]
        assert choice.finish_reason == "tool_calls"
    else:
        assert not choice.message.tool_calls and choice.finish_reason == "stop"


# --- litellm ------------------------------------------------------------------------------------

LITELLM_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        # As tools are written by hand: no additionalProperties, yet a forced call has no other keys.
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": list(CITIES)}},
                       "required": ["city"]},
    },
}


def test_litellm_named_tool_round_trip(served: Served) -> None:
    import litellm  # here, not at the top: its import reads the offline switches set for this module

    calls = WeatherCalls()
    common = {"model": f"openai/{served.model}", "api_base": served.server.api_url, "api_key": "none",
              "temperature": 0, "tools": [LITELLM_TOOL], "num_retries": 0, "timeout": 120,
              "reasoning_effort": "none"}
    messages: list = [{"role": "user", "content": QUESTION}]
    called = litellm.completion(messages=messages, max_tokens=CALL_TOKENS, parallel_tool_calls=False,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}}, **common)
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city"}, arguments
    result = calls.weather(arguments["city"])
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": result}]  # as litellm's docs do

    answer = litellm.completion(messages=messages, max_tokens=ANSWER_TOKENS, tool_choice="none", **common)
    assert not answer.choices[0].message.tool_calls
    assert isinstance(answer.choices[0].message.content, str) and answer.choices[0].message.content
