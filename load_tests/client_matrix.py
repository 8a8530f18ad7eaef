"""The client matrix: the libraries people point at an OpenAI endpoint, unchanged, against a running gateway —
each library × feature a pass or a fail with the reason. Run it against ``scripts/up.sh`` (SmolLM2, default
flags) to see what a new user sees:

    swarmserve up --port 18080 &                      # or scripts/up.sh --port 18080
    python load_tests/client_matrix.py --url http://127.0.0.1:18080 --label after

Writes ``load_tests/results/client-matrix-<label>.md`` (and prints it). A check passes only if the library's own
parsing accepts the answer and what the check asks holds (a valid object, exactly one call, a final answer).
Nothing leaves this machine: the Agents SDK's tracing is turned off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

RESULTS = Path(__file__).parent / "results"
RECORD = 'Here is a record: {"name":"Li Wei","age":31,"city":"Oslo"}. Return the person in it as JSON.'


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=20)


City = Literal["Paris", "Oslo", "Lima"]
Days = Annotated[int, Field(ge=1, le=14)]


def _openai(url: str, model: str) -> dict[str, Callable[[], str]]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=300, max_retries=0)
    person = Person.model_json_schema()
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
    tool = {"type": "function", "function": {"name": "save", "parameters": person, "strict": True}}

    def json_schema_speculating() -> str:
        bad = 0
        for seed in range(8):
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": RECORD}], response_format=schema, seed=seed,
                temperature=1.0, max_tokens=60,
            )  # fmt: skip
            c = r.choices[0]
            if c.finish_reason == "stop":
                try:
                    Person.model_validate_json(c.message.content)
                except ValueError:
                    bad += 1
        assert bad == 0, f"{bad} of 8 answers ended with stop and did not validate"
        return "8 seeds valid"

    def named_tool_once() -> str:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": RECORD}], tools=[tool], max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": "save"}},
        )  # fmt: skip
        m = r.choices[0].message
        assert m.content is None, f"content {m.content!r}"
        assert m.tool_calls and len(m.tool_calls) == 1, f"{len(m.tool_calls or [])} calls"
        Person.model_validate_json(m.tool_calls[0].function.arguments)
        return "one call, content null"

    def responses_function_tool() -> str:
        r = client.responses.create(
            model=model, input=RECORD, max_output_tokens=80, temperature=0,
            tools=[{"type": "function", "name": "save", "parameters": Person.model_json_schema(), "strict": True}],
            tool_choice={"type": "function", "name": "save"},
        )  # fmt: skip
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1, f"output {[o.type for o in r.output]}"
        return "function_call"

    return {
        "openai: json_schema + speculation": json_schema_speculating,
        "openai: named tool_choice": named_tool_once,
        "openai: responses.create(tools=)": responses_function_tool,
    }


def _agents(url: str, model: str) -> dict[str, Callable[[], str]]:
    def loop(api: str) -> Callable[[], str]:
        def run() -> str:
            import agents
            from openai import AsyncOpenAI

            agents.set_tracing_disabled(True)
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=300, max_retries=0)
            asked: list[str] = []

            @agents.function_tool
            def get_weather(city: City, days: Days) -> str:
                """The weather in a city for the next days."""
                asked.append(city)
                return f"It is sunny in {city} for {days} days."

            if api == "responses":
                chosen: object = agents.OpenAIResponsesModel(model=model, openai_client=client)
            else:
                chosen = agents.OpenAIChatCompletionsModel(model=model, openai_client=client)
            agent = agents.Agent(
                name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=chosen,
                model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=120, temperature=0),
            )  # fmt: skip
            result = asyncio.run(agents.Runner.run(agent, "What is the weather in Oslo for 3 days?", max_turns=4))
            assert len(asked) == 1, f"the tool ran {len(asked)} times"
            assert isinstance(result.final_output, str) and result.final_output, "no final answer"
            return f"tool once, answer {result.final_output[:40]!r}"

        return run

    return {"agents: Responses model tool loop": loop("responses"), "agents: Chat model tool loop": loop("chat")}


def _langchain(url: str, model: str) -> dict[str, Callable[[], str]]:
    def llm(**kw: object):
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="x", max_tokens=100, temperature=0, **kw)

    def tools(**kw: object) -> Callable[[], str]:
        def run() -> str:
            from langchain_core.tools import tool

            @tool
            def get_weather(city: City, days: Days) -> str:
                """The weather in a city for the next days."""
                return city

            message = llm(**kw).bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
            assert len(message.tool_calls) == 1, f"calls {message.tool_calls} invalid {message.invalid_tool_calls}"
            return "one call"

        return run

    def structured(method: str) -> Callable[[], str]:
        def run() -> str:
            person = llm().with_structured_output(Person, method=method).invoke(RECORD)
            assert isinstance(person, Person)
            return person.model_dump_json()

        return run

    return {
        "langchain: bind_tools": tools(),
        "langchain: bind_tools (use_responses_api)": tools(use_responses_api=True),
        "langchain: with_structured_output json_schema": structured("json_schema"),
        "langchain: with_structured_output function_calling": structured("function_calling"),
    }


def _instructor(url: str, model: str) -> dict[str, Callable[[], str]]:
    def mode(name: str) -> Callable[[], str]:
        def run() -> str:
            import instructor
            import openai

            client = instructor.from_openai(
                openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=300), mode=getattr(instructor.Mode, name)
            )
            person = client.chat.completions.create(
                model=model, response_model=Person, messages=[{"role": "user", "content": RECORD}], max_tokens=100,
                temperature=0, max_retries=0,
            )  # fmt: skip
            return person.model_dump_json()

        return run

    return {"instructor: TOOLS": mode("TOOLS"), "instructor: JSON_SCHEMA": mode("JSON_SCHEMA")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:18080")
    parser.add_argument("--label", default="run")
    args = parser.parse_args()
    import httpx

    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    checks: dict[str, Callable[[], str]] = {}
    for group in (_openai, _agents, _langchain, _instructor):
        checks.update(group(args.url, model))
    rows = []
    for name, check in checks.items():
        started = time.monotonic()
        try:
            outcome, detail = "pass", check()
        except Exception as e:  # a failed check is a row, not the end of the run
            outcome, detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            traceback.print_exc()
        rows.append((name, outcome, detail.replace("|", "/"), time.monotonic() - started))
        print(f"{outcome:4} {name}: {detail}", flush=True)
    lines = [
        f"# Client matrix ({args.label}): {model} at {args.url}, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| library: feature | result | detail | s |",
        "|---|---|---|---|",
        *(f"| {n} | {o} | {d} | {t:.1f} |" for n, o, d, t in rows),
        "",
        f"{sum(o == 'pass' for _, o, _, _ in rows)} of {len(rows)} pass.",
    ]
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"client-matrix-{args.label}.md"
    out.write_text("\n".join(lines) + "\n")
    print(json.dumps({"written": str(out)}))


if __name__ == "__main__":
    main()
