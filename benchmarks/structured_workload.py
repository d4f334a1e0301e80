"""Structured outputs' workload: extraction prompts, each with a JSON schema of its own shape, plus regexes, choices
and a grammar, as token ids for every timed run (`Workload`); shared by `bench.py --structured` (with or without
`--jump-forward-compare`) and the tests, which check every output against its constraint."""
import json
import re
from dataclasses import dataclass, field

from nanovllm import LLM, SamplingParams, StructuredOutputsParams

FRESH = 5  # one-token requests with a fresh schema (and as many without), interleaved, per round

TEXT = {"type": "string", "maxLength": 60}  # free text, bounded: a small model can run on in a string forever
PERSON = {"type": "object", "properties": {
    "name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"}},
    "required": ["name", "age", "email"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {
    "name": TEXT, "price": {"type": "number", "minimum": 0, "maximum": 100000},
    "currency": {"enum": ["USD", "EUR", "GBP"]}, "in_stock": {"type": "boolean"}},
    "required": ["name", "price", "currency", "in_stock"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "title": TEXT, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "attendees": {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 5}},
    "required": ["title", "date", "attendees"], "additionalProperties": False}
CONTACT = {"type": "object", "properties": {
    "name": TEXT,
    "address": {"type": "object", "properties": {
        "street": TEXT, "city": TEXT,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}},
    "required": ["name", "address"], "additionalProperties": False}
REVIEW = {"type": "object", "properties": {
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "summary": {"type": "string", "maxLength": 80}},
    "required": ["rating", "sentiment", "summary"], "additionalProperties": False}
RECIPE = {"$defs": {"ingredient": {"type": "object", "properties": {
    "item": TEXT, "quantity": TEXT}, "required": ["item", "quantity"],
    "additionalProperties": False}},
    "type": "object", "properties": {
    "title": TEXT, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
    "ingredients": {"type": "array", "items": {"$ref": "#/$defs/ingredient"}, "minItems": 1, "maxItems": 6}},
    "required": ["title", "servings", "ingredients"], "additionalProperties": False}
FLIGHT = {"type": "object", "properties": {
    "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "passengers": {"type": "integer", "minimum": 1, "maximum": 9}, "class": {"enum": ["economy", "business"]}},
    "required": ["from", "to", "passengers", "class"], "additionalProperties": False}
COMPANY = {"type": "object", "properties": {
    "name": TEXT, "founded": {"type": "integer", "minimum": 1800, "maximum": 2025},
    "employees": {"type": "integer", "minimum": 1},
    "industries": {"type": "array", "items": {"enum": ["software", "hardware", "retail", "energy", "finance"]},
                   "maxItems": 3}},
    "required": ["name", "founded", "employees", "industries"], "additionalProperties": False}

DOCUMENTS = [
    (PERSON, ["Alice Martin is 34 years old; write to her at alice.martin@example.com.",
              "Our new hire, Bob Chen (29), can be reached at bob@corp.io.",
              "Contact: Dr. Carla Diaz, age 52, email carla.diaz@uni.edu.",
              "Dave, 41, prefers dave@mail.org for anything urgent."]),
    (PRODUCT, ["The UltraBlend 3000 blender costs 89.99 dollars and is in stock.",
               "Sold out: the Trailmaster tent, 249 EUR.",
               "Classic leather wallet, 35 pounds sterling, available now.",
               "The Nimbus e-reader sells for 129 USD; currently unavailable."]),
    (EVENT, ["The board meeting on 2024-03-15 will be attended by Ann, Raj and Tom.",
             "Kim and Lee are going to the jazz night on 2025-07-04.",
             "Product launch, 2024-11-20: Maria, Omar, Sven and Yuki will present.",
             "Sam is hosting the book club on 2024-09-01."]),
    (CONTACT, ["Send the parcel to Jane Doe, 12 Oak Street, Springfield, 62704.",
               "John Smith lives at 450 Pine Avenue in Portland, zip code 97201.",
               "Deliver to Priya Patel: 7 Elm Road, Austin 73301.",
               "Mail for Luis Gomez goes to 88 Harbor Lane, Miami, 33101."]),
    (REVIEW, ["Absolutely loved this coffee maker, it brews fast and tastes great. Five stars!",
              "The headphones broke after two days. Terrible quality, one star.",
              "It is an okay backpack, nothing special, three stars.",
              "Good value for the price, the lamp is bright; four stars from me."]),
    (RECIPE, ["Pancakes for 4: 2 cups flour, 2 eggs, 1.5 cups milk, 1 tbsp sugar.",
              "Guacamole serves 2: 2 avocados, 1 lime, a pinch of salt.",
              "Tomato soup for 6 people: 8 tomatoes, 1 onion, 2 cloves garlic, 1 liter stock.",
              "Simple omelette for one: 3 eggs, 20 g butter, salt and pepper."]),
    (FLIGHT, ["Book 2 business seats from JFK to LHR.",
              "One economy ticket, Paris CDG to Tokyo HND please.",
              "We are 4 people flying economy from SFO to SEA.",
              "Business class for 1 passenger, Berlin BER to Madrid MAD."]),
    (COMPANY, ["Acme Corp was founded in 1947, employs 1200 people and works in hardware and retail.",
               "Founded in 2012, Brightpath is a software firm with 85 employees.",
               "Helios Power (energy, finance) started in 1998 and has 5400 staff.",
               "Northwind, a retail company since 1875, has 300 employees."]),
]

REGEXES = [(r"[0-9]{3}-[0-9]{3}-[0-9]{4}", "Write a US phone number for Alice's office."),
           (r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day, [0-9]{1,2} (January|March|July) 20[0-9]{2}",
            "When is the next team meeting? Answer with a date."),
           (r"[A-Z][a-z]{1,15} [A-Z][a-z]{1,15}", "Name a famous scientist."),
           (r"(yes|no), because [a-z ,]{10,60}\.", "Is the sky blue? Answer and explain briefly.")]
CHOICES = [(["positive", "negative", "neutral"], "Classify the sentiment: 'I really enjoyed the movie!'"),
           (["Paris", "London", "Berlin", "Madrid"], "What is the capital of France?"),
           (["cat", "dog", "bird"], "Which animal barks?")]
ARITHMETIC = """root ::= expr "=" number
expr ::= number (op number){0,3}
op ::= " + " | " - " | " * "
number ::= [1-9] [0-9]{0,3}
"""
GRAMMARS = [(ARITHMETIC, "Write a simple arithmetic equation with its result."),
            (ARITHMETIC, "What is 12 plus 30? Write the equation.")]


@dataclass
class Case:
    """One prompt and its constraint (`StructuredOutputsParams` keyword arguments), and how to check an output."""

    message: str
    constraint: dict
    schema: dict | None = field(default=None, repr=False)

    def problem(self, text: str) -> str | None:
        """Why `text` does not satisfy the constraint (None if it does)."""
        kind, value = next(iter(self.constraint.items()))
        if kind == "json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                return f"not JSON: {e}"
            import jsonschema

            try:
                jsonschema.validate(data, value)
            except jsonschema.ValidationError as e:
                return f"does not fit the schema: {e.message}"
            return None
        if kind == "regex":
            return None if re.fullmatch(value, text) else "does not match the regex"
        if kind == "choice":
            return None if text in value else "is not one of the choices"
        return None if _arithmetic(text) else "does not follow the grammar"


def _arithmetic(text: str) -> bool:
    return re.fullmatch(r"[1-9][0-9]{0,3}(( \+ | - | \* )[1-9][0-9]{0,3}){0,3}=[1-9][0-9]{0,3}", text) is not None


def json_cases(label: str = "") -> list[Case]:
    """32 extraction prompts: 8 schemas of different shapes, 4 documents each. A `label` goes before each document
    (after the schema, so prompts of one schema still share their opening): runs with labels of their own share
    no prompt, and an engine's prefix cache cannot carry one run's prompts into the next."""
    return [Case(f"Extract the information as JSON with this schema: {json.dumps(schema)}\n\nText{label}: {document}",
                 {"json": schema}, schema) for schema, documents in DOCUMENTS for document in documents]


def varied_cases() -> list[Case]:
    """Every kind of constraint: the JSON cases, regexes, choices and a grammar."""
    return (json_cases() + [Case(m, {"regex": r}) for r, m in REGEXES] + [Case(m, {"choice": c}) for c, m in CHOICES]
            + [Case(m, {"grammar": g}) for g, m in GRAMMARS])


def fresh_schema(index: int) -> dict:
    """A typical schema no run has seen before (a property name of its own)."""
    return {"type": "object", "properties": {f"field_{index}": TEXT, "count": {"type": "integer"},
                                             "tags": {"type": "array", "items": TEXT}},
            "required": [f"field_{index}", "count", "tags"], "additionalProperties": False}


def fresh_constraint(constraint: dict, label: str) -> dict:
    """`constraint` under a grammar text no run has compiled yet: a JSON schema with a `$comment` of `label` (a comment
    only, so the same language and the same outputs), which an engine's cache of compiled grammars (keyed on the text)
    has not seen; so a run with a label of its own compiles its grammars. Other kinds are returned as they are."""
    if "json" not in constraint or not isinstance(constraint["json"], dict):
        return constraint
    return {**constraint, "json": {"$comment": label, **constraint["json"]}}


def constrained(case: Case, label: str | None = None, **settings) -> SamplingParams:
    """`case`'s sampling parameters under its constraint (compiled afresh with a `label`, see `fresh_constraint`)."""
    constraint = case.constraint if label is None else fresh_constraint(case.constraint, label)
    return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **settings)


def warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """A round's warm-up batch, as large as its timed ones: its prompts reversed, so that no timed prompt shares a
    cached block with them. An engine's first step of that size pays a one-time cost (nanovllm's first 32-prompt step
    took ~2 s more than later ones; vLLM runs a batch at start-up)."""
    return [p[::-1] for p in prompts]


class Workload:
    """Token ids for every timed run, the same for both engines: per round a constrained and an unconstrained set of
    the extraction prompts (documents labelled with the run), the fresh prompts of the TTFT requests, the checks."""

    def __init__(self, cases: list[Case], rounds: list[dict[str, list[list[int]]]], ttft: list[list[int]],
                 checks: list[Case], check_prompts: list[list[int]], max_tokens: int):
        self.cases, self.rounds, self.ttft = cases, rounds, ttft
        self.checks, self.check_prompts, self.max_tokens = checks, check_prompts, max_tokens

    @classmethod
    def make(cls, llm: LLM, count: int, checks: list[Case], max_tokens: int, repeat: int) -> "Workload":
        def prompts(cases: list[Case]) -> list[list[int]]:
            return [llm.chat_prompt([{"role": "user", "content": c.message}]) for c in cases]

        def labelled(label: str) -> list[Case]:
            cases = json_cases(label)
            return [cases[i % len(cases)] for i in range(count)]

        rounds = [{kind: prompts(labelled(f" {number}{kind[0]}")) for kind in ("constrained", "unconstrained")}
                  for number in range(repeat)]
        first = json_cases()[0]
        ttft = prompts([Case(f"Ticket {number}. {first.message}", first.constraint) for number in range(2 * FRESH
                                                                                                        * repeat)])
        return cls(labelled(""), rounds, ttft, checks, prompts(checks), max_tokens)
