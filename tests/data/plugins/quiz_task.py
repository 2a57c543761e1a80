"""A user's own task, as a user writes it outside the project (tests copy this file to a temporary
folder and name it by path: ``data.task=code/quiz_task.py:task``).

Lookup questions ("Which city is the capital of Peru?") answered by exact match, with the task's
own tool (``lookup``, an atlas), its own reward (``compute_score``, verl's contract) and its own
answer extraction (``Answer: <city>``). Every call of the reward and of the tool appends one JSON
line to ``$QUIZ_LOG`` (pid, event, arguments): the plugin's own record of what it received.

``hang``, ``boom``, ``nan`` and ``text`` are rewards that misbehave, for the bounded-reward tests.
"""

import hashlib
import json
import os
import re
import time

from agent_env.tasks import Task
from tools import Tool, ToolResult

CAPITALS = {
    "France": "Paris",
    "Peru": "Lima",
    "Japan": "Tokyo",
    "Kenya": "Nairobi",
    "Chile": "Santiago",
    "Egypt": "Cairo",
    "Norway": "Oslo",
    "Canada": "Ottawa",
    "Spain": "Madrid",
    "Italy": "Rome",
    "Ghana": "Accra",
    "Cuba": "Havana",
    "Nepal": "Kathmandu",
    "Iran": "Tehran",
    "Fiji": "Suva",
    "Mali": "Bamako",
    "Laos": "Vientiane",
    "Oman": "Muscat",
    "Chad": "N'Djamena",
    "Togo": "Lome",
}
DATA_SOURCE = "quiz/capitals"


def _log(**record):
    path = os.environ.get("QUIZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **record}) + "\n")


def _split_of(country):
    return "test" if hashlib.sha256(country.encode()).digest()[0] % 4 == 0 else "train"


def make_split(split, n, seed=0):
    countries = [c for c in sorted(CAPITALS) if _split_of(c) == split]
    items = []
    for i in range(n):
        country = countries[(i + seed) % len(countries)]
        items.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [
                    {
                        "role": "user",
                        "content": f"Which city is the capital of {country}? Use the lookup tool, "
                        "then reply 'Answer: <city>'.",
                    }
                ],
                "reward_model": {"style": "rule", "ground_truth": CAPITALS[country]},
                "extra_info": {"split": split, "index": i, "country": country},
            }
        )
    return items


def extract_answer(text):
    found = re.findall(r"Answer:\s*([^\n]+)", text)
    return found[-1].strip() if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    extra_info = extra_info or {}
    answer = extra_info.get("extracted_answer")
    hit = float(answer is not None and answer.strip().lower() == str(ground_truth).lower())
    _log(
        event="reward",
        data_source=data_source,
        ground_truth=ground_truth,
        answer=answer,
        num_tool_calls=extra_info.get("num_tool_calls"),
        country=extra_info.get("country"),
    )
    return {"score": hit, "acc": hit}


class Atlas(Tool):
    name = "lookup"
    description = "Look up a query in the atlas and return a short note."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to look up"}},
        "required": ["query"],
    }

    async def call(self, args, *, session_id=None):
        _log(event="tool", args=args)
        query = str(args.get("query", ""))
        hits = [f"{c}: {city}" for c, city in CAPITALS.items() if query.lower() in c.lower()]
        return ToolResult(text="; ".join(hits) or f"no entry for {query!r}")


task = Task(
    name="quiz",
    data_source=DATA_SOURCE,
    make_split=make_split,
    reward=f"{__file__}:compute_score",
    extract_answer=extract_answer,
    tools=(f"{__file__}:Atlas",),
)


# --- rewards that misbehave ---------------------------------------------------------------------


def hang(data_source, solution_str, ground_truth, extra_info=None):
    _log(event="hang")
    time.sleep(3600)


def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("the checker crashed")


def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")


def text(data_source, solution_str, ground_truth, extra_info=None):
    return "correct!"
