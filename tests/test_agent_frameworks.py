"""The client libraries people build agents with, unchanged, against a gateway over a real 2-worker swarm:
instructor (TOOLS and JSON_SCHEMA modes), LangChain's ``ChatOpenAI`` (``bind_tools``, ``with_structured_output``
by JSON schema and by function calling) and the OpenAI Agents SDK's Chat Completions model running a tool loop
to a final answer. Pinned in the ``test`` extra (instructor is installed by scripts/setup.sh: it pins an older
jiter than the openai SDK needs).

The model is a tiny random Llama: every call and every object that validates here is the gateway's grammar's
work, and each library's own parsing and validation is what checks it. Nothing leaves this machine: the Agents
SDK's tracing (which would upload to OpenAI) is turned off.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.gateway_fixtures import REQUEST_TIMEOUT_S, Gateway

pytestmark = pytest.mark.slow

#: enough for any instance of the models below (every value bounded)
MAX_TOKENS = 120


class Weather(BaseModel):
    """The weather in a city."""

    # no other keys: a schema that allows them lets a random model write them until max_tokens
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=14)
    metric: bool


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def gw(calm_swarm_gateway: Gateway) -> Gateway:
    return calm_swarm_gateway


def test_instructor_tools_and_json_schema_modes(gw: Gateway) -> None:
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(gw.client(), mode=mode)
        for seed in range(3):
            weather = client.chat.completions.create(
                model=gw.model,
                response_model=Weather,
                messages=[{"role": "user", "content": "The weather in Paris for 3 days, in metric units."}],
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=seed,
                max_retries=0,  # a retry would hide an invalid first answer
            )
            assert isinstance(weather, Weather), mode


def test_langchain_bind_tools_and_structured_output(gw: Gateway) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool  # (bounded, or a random model writes digits until max_tokens: the schema would allow it)
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: Annotated[int, Field(ge=1, le=14)]) -> str:
        """The weather in a city for the next days."""
        return f"{city}: sunny for {days} days"

    llm = ChatOpenAI(
        model=gw.model, base_url=gw.server.base_url, api_key="x", max_tokens=MAX_TOKENS, temperature=0,
        timeout=REQUEST_TIMEOUT_S, max_retries=0,
    )  # fmt: skip
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo for 2 days?")
    (call,) = message.tool_calls  # a named choice: exactly one call
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo", "Lima")
    assert get_weather.invoke(call["args"]).endswith("days")  # the arguments fit the tool's own signature
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Li Wei is 31. Extract the person.")
        assert isinstance(person, Person), method


def test_agents_sdk_chat_completions_model_runs_a_tool_loop(gw: Gateway) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: Annotated[int, Field(ge=1, le=14)]) -> str:
        """The weather in a city for the next days."""
        calls.append((city, days))
        return f"{city}: sunny for {days} days"

    client = AsyncOpenAI(base_url=gw.server.base_url, api_key="x", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=gw.model, openai_client=client),
        # the first turn must call the tool, once (a named choice: the audit saw the SDK run it twice when the
        # grammar let the model repeat the call); after it the SDK resets the choice to auto (its default), so
        # the random model's next turn is text: the final answer
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=MAX_TOKENS, temperature=0),
    )
    result = Runner.run_sync(agent, "What is the weather in Lima for 4 days?", max_turns=4)
    assert len(calls) == 1 and calls[0][0] in ("Paris", "Oslo", "Lima")
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
