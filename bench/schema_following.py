"""How often a plain pydantic model comes back complete and valid from the embedded model: the
openai SDK's `chat.completions.parse(response_format=Model, max_tokens=200)`, as a LangChain
tutorial would call it, with the schema shown to the model and without.

    python -m bench.schema_following [--max-tokens 200] [--seeds 5] [--concurrency 12]
                                     [--doc docs/benchmarks/schema_following.md]

Starts seqgate (`python -m app serve`) on a free loopback port. Each of the `MODELS` (plain
pydantic models with no `max_length` or `maximum`, as users write them) is asked for with its
prompt greedily and at temperature 1 with `--seeds` seeds, once with the server showing the
schema (`schema_prompt: true`, the default) and once without (`false`: the grammar alone). An
answer counts as valid when the SDK parses it into the model: the JSON completed within
`max_tokens` (else `finish_reason` is "length" and the SDK raises) and pydantic accepts it.
Targets: at least 9 in 10 valid greedy and 8 in 10 sampled, with the schema shown.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import openai
import pydantic
from pydantic import BaseModel, Field

from bench import harness, provenance
from bench.servers import ServerProcess, ServerSpec


class City(BaseModel):
    name: str
    country: str
    population_millions: float = Field(ge=0, le=100)


class Person(BaseModel):
    name: str
    age: int
    occupation: str


class Joke(BaseModel):
    setup: str = Field(description="The setup of the joke")
    punchline: str = Field(description="The punchline to the joke")
    rating: int | None = Field(default=None, description="How funny the joke is, from 1 to 10")


class Movie(BaseModel):
    title: str
    year: int
    director: str
    genres: list[str]


class Recipe(BaseModel):
    name: str
    ingredients: list[str]
    minutes: int


class Classification(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    aggressiveness: int = Field(description="How aggressive the text is, from 1 to 10")
    language: str = Field(description="The language the text is written in")


class Product(BaseModel):
    name: str
    price: float
    in_stock: bool


class CalendarEvent(BaseModel):
    name: str
    date: str
    participants: list[str]


class Address(BaseModel):
    street: str
    city: str
    postal_code: str
    country: str


class WeatherReport(BaseModel):
    city: str
    temperature_celsius: float
    conditions: str


class Step(BaseModel):
    explanation: str
    output: str


class MathReasoning(BaseModel):
    steps: list[Step]
    final_answer: str


class Book(BaseModel):
    title: str
    author: str
    year: int
    summary: str


MODELS: list[tuple[type[BaseModel], str]] = [
    (City, "Describe Paris as a city record."),
    (Person, "Alice is a 34-year-old nurse from Lyon. Extract the person."),
    (Joke, "Tell me a joke about cats."),
    (Movie, "Give me the details of the movie Inception."),
    (Recipe, "Give me a simple recipe for pancakes."),
    (Classification, "Classify this text: 'I am so happy with my new phone, it works great!'"),
    (Product, "A red bicycle costs 199.99 dollars and is available now. Extract the product."),
    (CalendarEvent, "Alice and Bob are going to a science fair on Friday."),
    (Address, "Extract the address: 10 Downing Street, London SW1A 2AA, United Kingdom."),
    (WeatherReport, "Write a weather report for Madrid on a sunny summer day."),
    (MathReasoning, "How can I solve 8x + 7 = -23?"),
    (Book, "Tell me about the book 1984."),
]


async def ask(client: openai.AsyncOpenAI, model: str, schema: type[BaseModel], prompt: str,
              shown: bool, seed: int | None, max_tokens: int) -> dict:
    """One parse call: whether it came back valid, and if not, why."""
    kwargs = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    t0 = time.perf_counter()
    out = {"model": schema.__name__, "shown": shown, "seed": seed}
    try:
        completion = await client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": prompt}], response_format=schema,
            max_tokens=max_tokens, extra_body={"schema_prompt": shown}, **kwargs)
        message = completion.choices[0].message
        out.update(valid=message.parsed is not None, tokens=completion.usage.completion_tokens,
                   prompt_tokens=completion.usage.prompt_tokens, text=message.content)
    except openai.LengthFinishReasonError as exc:
        out.update(valid=False, why="length", tokens=exc.completion.usage.completion_tokens,
                   text=exc.completion.choices[0].message.content)
    except pydantic.ValidationError as exc:
        out.update(valid=False, why=f"invalid: {exc.errors()[0]['msg']}")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


async def run_all(url: str, model: str, seeds: int, max_tokens: int, concurrency: int
                  ) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(*args) -> dict:
        async with gate:
            return await ask(client, model, *args, max_tokens)

    calls = [one(schema, prompt, shown, seed)
             for shown in (True, False) for schema, prompt in MODELS
             for seed in (None, *range(seeds))]
    return list(await asyncio.gather(*calls))


def summary(results: list[dict]) -> list[dict]:
    rows = []
    for shown in (True, False):
        for mode, pick in (("greedy", lambda r: r["seed"] is None),
                           ("temperature 1", lambda r: r["seed"] is not None)):
            got = [r for r in results if r["shown"] == shown and pick(r)]
            valid = sum(r["valid"] for r in got)
            rows.append({"schema shown": shown, "sampling": mode, "valid": valid,
                         "answers": len(got), "fraction": valid / len(got) if got else None,
                         "cut by max_tokens": sum(r.get("why") == "length" for r in got),
                         "mean prompt tokens": round(sum(r.get("prompt_tokens", 0) for r in got)
                                                     / max(1, sum("prompt_tokens" in r
                                                                  for r in got)), 1)})
    return rows


def report(data: dict) -> str:
    rows = data["summary"]
    lines = [harness.markdown_table(
        ["schema shown", "sampling", "valid", "of", "fraction", "cut by max_tokens",
         "mean prompt tokens"],
        [["yes" if r["schema shown"] else "no", r["sampling"], r["valid"], r["answers"],
          harness.fmt(r["fraction"]), r["cut by max_tokens"], r["mean prompt tokens"]]
         for r in rows])]
    failing = sorted({(r["model"], r["seed"]) for r in data["results"]
                      if r["shown"] and not r["valid"]}, key=str)
    lines.append(f"\nWith the schema shown, not valid: "
                 f"{', '.join(f'{m} (seed {s})' for m, s in failing) or 'none'}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = harness.parse_args(__doc__, "schema_following", argv, max_tokens=200, seeds=5,
                              concurrency=12, server_arg=harness.SERVER_ARG)
    spec = ServerSpec("seqgate", "app", tuple(args.server_arg))
    with ServerProcess(spec, None, harness.server_log(args.out, "server")) as server:
        results = asyncio.run(run_all(server.base_url, server.served_name or "",
                                      args.seeds, args.max_tokens, args.concurrency))
    data = {"meta": provenance.meta(argv, "bench.schema_following", args),
            "summary": summary(results), "results": results}
    harness.publish(data, args.out, report(data), args.doc,
                    "Structured outputs a small model can follow",
                    f"{len(MODELS)} plain pydantic models through the openai SDK's "
                    f"`chat.completions.parse`, max_tokens {args.max_tokens}, greedy and at "
                    f"temperature 1 with {args.seeds} seeds, the schema shown and not.")


if __name__ == "__main__":
    main()
