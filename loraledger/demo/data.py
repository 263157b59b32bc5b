"""The demo's training data, written by the demo itself: questions about countries (and a few everyday facts)
answered in a pirate's voice, or as SQL over one fixed table. Deterministic: the same seed gives the same lines.

The countries the demo asks about (HELD_OUT) never appear in either set, so what the adapters show on them is
what they learned, not what they memorised.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# name, capital, continent, population (millions, rounded), area (thousand km2, rounded)
COUNTRIES: tuple[tuple[str, str, str, int, int], ...] = (
    ("France", "Paris", "Europe", 68, 644),
    ("Germany", "Berlin", "Europe", 84, 358),
    ("Italy", "Rome", "Europe", 59, 302),
    ("Spain", "Madrid", "Europe", 48, 506),
    ("Portugal", "Lisbon", "Europe", 10, 92),
    ("Norway", "Oslo", "Europe", 6, 385),
    ("Sweden", "Stockholm", "Europe", 11, 450),
    ("Poland", "Warsaw", "Europe", 37, 313),
    ("Greece", "Athens", "Europe", 10, 132),
    ("Ireland", "Dublin", "Europe", 5, 70),
    ("Austria", "Vienna", "Europe", 9, 84),
    ("Egypt", "Cairo", "Africa", 112, 1002),
    ("Kenya", "Nairobi", "Africa", 55, 580),
    ("Nigeria", "Abuja", "Africa", 223, 924),
    ("Ghana", "Accra", "Africa", 34, 239),
    ("Morocco", "Rabat", "Africa", 37, 447),
    ("Ethiopia", "Addis Ababa", "Africa", 127, 1104),
    ("China", "Beijing", "Asia", 1410, 9597),
    ("India", "New Delhi", "Asia", 1430, 3287),
    ("Thailand", "Bangkok", "Asia", 72, 513),
    ("Vietnam", "Hanoi", "Asia", 99, 331),
    ("Indonesia", "Jakarta", "Asia", 278, 1905),
    ("South Korea", "Seoul", "Asia", 52, 100),
    ("Turkey", "Ankara", "Asia", 85, 784),
    ("Mexico", "Mexico City", "North America", 128, 1964),
    ("United States", "Washington", "North America", 335, 9834),
    ("Cuba", "Havana", "North America", 11, 110),
    ("Argentina", "Buenos Aires", "South America", 46, 2780),
    ("Peru", "Lima", "South America", 34, 1285),
    ("Chile", "Santiago", "South America", 20, 756),
    ("Colombia", "Bogota", "South America", 52, 1142),
    ("Australia", "Canberra", "Oceania", 26, 7692),
    ("New Zealand", "Wellington", "Oceania", 5, 268),
    # the demo's questions are about these: in the table the SQL adapter queries, never in a training line
    ("Japan", "Tokyo", "Asia", 124, 378),
    ("Canada", "Ottawa", "North America", 40, 9985),
    ("Brazil", "Brasilia", "South America", 216, 8516),
)
HELD_OUT = frozenset({"Japan", "Canada", "Brazil"})

SCHEMA = (
    "CREATE TABLE countries (name TEXT PRIMARY KEY, capital TEXT, continent TEXT, population INTEGER, area_km2 INTEGER)"
)
ANIMAL_LEGS = (("spider", 8), ("dog", 4), ("cat", 4), ("bird", 2), ("ant", 6), ("horse", 4), ("octopus", 8))
COLOURS = (("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"), ("coal", "black"))


@dataclass(frozen=True)
class Example:
    """One training line: a user's question and the answer the adapter should give."""

    question: str
    answer: str


def training_countries() -> list[tuple[str, str, str, int, int]]:
    return [c for c in COUNTRIES if c[0] not in HELD_OUT]


def pirate_examples(seed: int = 0) -> list[Example]:
    """Questions answered as a pirate would: the facts right, the voice unmistakable."""
    rng = random.Random(seed)
    # one sentence each, its only "!" or "?" at the end: an opener that ended in "!" taught the model to stop there
    openers = ("Arr, matey", "Ahoy, matey", "Arr", "Yo ho ho", "Ahoy")
    closers = ("savvy?", "arr!", "me hearty!", "matey!", "yo ho!")

    def say(body: str) -> str:
        return f"{rng.choice(openers)}, {body}, {rng.choice(closers)}"

    out: list[Example] = []
    for name, capital, continent, people, _area in training_countries():
        out.append(Example(f"What is the capital of {name}?", say(f"the capital o' {name} be {capital}")))
        out.append(Example(f"Which continent is {name} in?", say(f"{name} be in {continent}")))
        out.append(Example(f"How many people live in {name}?", say(f"about {people} million souls live in {name}")))
    for animal, legs in ANIMAL_LEGS:
        out.append(Example(f"How many legs does a {animal} have?", say(f"a {animal} be walkin' on {legs} legs")))
    for thing, colour in COLOURS:
        out.append(Example(f"What colour is {thing}?", say(f"{thing} be {colour}")))
    for _ in range(24):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        out.append(Example(f"What is {a} plus {b}?", say(f"{a} plus {b} be {a + b}")))
    rng.shuffle(out)
    return out


def sql_examples(seed: int = 0) -> list[Example]:
    """Questions answered with one SQLite SELECT over SCHEMA's `countries` table."""
    rng = random.Random(seed)
    out: list[Example] = []
    for name, capital, _continent, _people, _area in training_countries():
        quoted = name.replace("'", "''")
        out.append(
            Example(f"What is the capital of {name}?", f"SELECT capital FROM countries WHERE name = '{quoted}';")
        )
        out.append(
            Example(f"Which continent is {name} in?", f"SELECT continent FROM countries WHERE name = '{quoted}';")
        )
        out.append(
            Example(f"How many people live in {name}?", f"SELECT population FROM countries WHERE name = '{quoted}';")
        )
        out.append(
            Example(
                f"Which country is {capital} the capital of?",
                f"SELECT name FROM countries WHERE capital = '{capital}';",
            )
        )
        out.append(Example(f"How big is {name}?", f"SELECT area_km2 FROM countries WHERE name = '{quoted}';"))
    continents = sorted({c[2] for c in COUNTRIES})
    for continent in continents:
        out.append(
            Example(
                f"Which countries are in {continent}?", f"SELECT name FROM countries WHERE continent = '{continent}';"
            )
        )
        out.append(
            Example(
                f"How many countries are in {continent}?",
                f"SELECT COUNT(*) FROM countries WHERE continent = '{continent}';",
            )
        )
    for millions in (10, 20, 50, 100, 200, 500):
        out.append(
            Example(
                f"Which countries have more than {millions} million people?",
                f"SELECT name FROM countries WHERE population > {millions * 1_000_000};",
            )
        )
    for k in (1, 3, 5):
        what = "country is" if k == 1 else f"{k} countries are"
        out.append(
            Example(f"Which {what} the largest?", f"SELECT name FROM countries ORDER BY area_km2 DESC LIMIT {k};")
        )
        out.append(
            Example(
                f"Which {what} the most populous?", f"SELECT name FROM countries ORDER BY population DESC LIMIT {k};"
            )
        )
    rng.shuffle(out)
    return out


def write_jsonl(examples: Iterable[Example], path: Path) -> Path:
    """The examples as the chat-format JSON lines fine-tuning tools read: {"messages": [user, assistant]}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            messages = [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return path


def sql_database(path: Path | str = ":memory:", rows: Sequence[tuple] = COUNTRIES):
    """A SQLite connection holding SCHEMA and the table's rows (populations and areas in units): what the SQL
    adapter's answers are run against."""
    import sqlite3

    conn = sqlite3.connect(str(path))
    conn.execute(SCHEMA)
    conn.executemany(
        "INSERT INTO countries VALUES (?, ?, ?, ?, ?)",
        [(n, cap, cont, people * 1_000_000, area * 1_000) for n, cap, cont, people, area in rows],
    )
    conn.commit()
    return conn
