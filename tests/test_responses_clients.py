"""Client libraries that speak the Responses API, unchanged, against the in-process gateway over the tiny
random Llama: the OpenAI Agents SDK's default model (Responses) running a tool loop, and langchain-openai's
``ChatOpenAI(use_responses_api=True).bind_tools(...)`` getting a function call. A random model writes
garbage, so the first call is forced with a named ``tool_choice`` and the agent's final answer is shaped by a
strict ``output_type`` (``text.format``), whose grammar ends it.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

from tests.gateway_fixtures import REQUEST_TIMEOUT_S, Gateway, shared_gateway


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


def test_agents_sdk_runs_a_tool_loop(gw: Gateway) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # else it uploads traces to OpenAI
    client = AsyncOpenAI(base_url=gw.server.base_url, api_key="x", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    class Answer(BaseModel):
        sunny: bool

    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        model=gw.model,
        tools=[get_weather],
        output_type=Answer,  # a strict schema: the grammar ends the final answer, which a random model may not
        # the first turn must call the tool; the SDK resets the choice to auto after it (reset_tool_choice)
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=200),
    )
    # the whole history as input items each turn (the default), then chained by previous_response_id
    for chained in (False, True):
        asked.clear()
        result = agents.Runner.run_sync(
            agent, "What is the weather in Paris?", max_turns=4, auto_previous_response_id=chained
        )
        assert asked and asked[0] in ("Paris", "Oslo", "Lima")
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
        assert isinstance(result.final_output, Answer)
        responses = result.raw_responses
        assert len(responses) >= 2 and all(r.response_id and r.response_id.startswith("resp_") for r in responses)
        second = gw.client().responses.retrieve(responses[1].response_id)  # the same API key: the same owner
        assert second.previous_response_id == (responses[0].response_id if chained else None)


def test_langchain_responses_api_bind_tools_gets_a_call(gw: Gateway) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    llm = langchain_openai.ChatOpenAI(
        model=gw.model,
        base_url=gw.server.base_url,
        api_key="x",
        use_responses_api=True,
        temperature=0,
        max_tokens=60,
        timeout=REQUEST_TIMEOUT_S,
        max_retries=0,
    )
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo", "Lima")
    assert call["id"].startswith("call_") and message.response_metadata["id"].startswith("resp_")
    streamed = None
    for chunk in llm.bind_tools([get_weather], tool_choice="get_weather").stream("What is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [c["args"] for c in streamed.tool_calls] == [call["args"]]
