"""loraledger.demo.data: the training lines are deterministic, right, and never about the demo's questions."""

from __future__ import annotations

import json

from loraledger.demo.data import COUNTRIES, HELD_OUT, pirate_examples, sql_database, sql_examples, write_jsonl
from loraledger.demo.mixed_batch import QUESTIONS, pirate_like, sql_select


def test_examples_are_deterministic_and_leave_out_what_the_demo_asks():
    for make in (pirate_examples, sql_examples):
        assert make(0) == make(0) and make(0) != make(1)  # the same seed, the same lines; another seed, another order
        text = " ".join(f"{e.question} {e.answer}" for e in make(0))
        assert not any(country in text for country in HELD_OUT)
    assert all(any(country in q for country in HELD_OUT) for q in QUESTIONS)


def test_every_pirate_line_speaks_like_a_pirate_and_every_sql_line_runs():
    assert all(pirate_like(e.answer) for e in pirate_examples())
    assert not pirate_like("The capital of Japan is Tokyo.")
    conn = sql_database()
    capitals = {name: capital for name, capital, *_ in COUNTRIES}
    for e in sql_examples():
        assert sql_select(e.answer), e.answer
        rows = conn.execute(e.answer).fetchall()
        assert rows, f"{e.answer} returns nothing"
        if e.question.startswith("What is the capital of "):
            assert rows == [(capitals[e.question.removeprefix("What is the capital of ").rstrip("?")],)]
    assert not sql_select("The capital of Japan is Tokyo.")
    assert not sql_select("SELECT capital FROM nations")  # SQLite knows no such table
    assert not sql_select("DELETE FROM countries")


def test_written_as_chat_lines(tmp_path):
    path = write_jsonl(pirate_examples()[:3], tmp_path / "d" / "train.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [[m["role"] for m in line["messages"]] for line in lines] == [["user", "assistant"]] * 3
    assert lines[0]["messages"][1]["content"] == pirate_examples()[0].answer
