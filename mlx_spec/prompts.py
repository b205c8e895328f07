"""The fixed built-in prompt set (code, math, prose, agent) shared by bench, tune and verify.

Fixed text, never generated, so numbers measured on different days compare. The prompts are
chat requests that make a small instruct model write a few hundred tokens. They are kept apart
from the training prompts (mlx_spec/train/prompts.py) so a drafter is not benched on its own data.
The agent kind is what coding agents ask: a conversation that hands the model a file or a
function and asks for it back with one change (rename, docstrings, a method, type hints, a JSON
field, a config value), so most of the reply repeats the prompt; agent-7 and agent-8 hand over
longer files for longer copying replies. The tuner races on the chat kinds only
(``CHAT_KINDS``): agent prompts are long and their prefill would dominate its short runs.
A user's set (for bench, verify and ``train data``) comes from a JSONL file: one JSON string per
line, or an object with ``prompt`` (or ``text``, or ``messages``) and optionally ``kind`` (else
taken from an id like ``code-12``, else "user"), ``id`` and ``chat`` (default true: apply the
tokenizer's chat template).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import BadRequest
from .text import encode_prompt

CHAT_KINDS = ("code", "math", "prose")
KINDS = CHAT_KINDS + ("agent",)
WORKLOADS = {"all": KINDS, "chat": CHAT_KINDS, "agent": ("agent",)}


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    kind: str  # code | math | prose | agent | user
    text: str = ""
    messages: tuple | None = None  # chat messages (dicts); overrides text
    chat: bool = True  # apply the chat template

    def encode(self, tokenizer) -> list[int]:
        if self.messages is not None:
            return encode_prompt(tokenizer, messages=list(self.messages))
        return encode_prompt(tokenizer, self.text, chat=self.chat)


BUILTIN = (
    Prompt(
        "code-1",
        "code",
        "Write a Python function that checks whether a string is a valid "
        "IPv4 address. Include a docstring and three example calls.",
    ),
    Prompt(
        "code-2",
        "code",
        "Implement a Python class `LRUCache` with `get` and `put` methods, "
        "using collections.OrderedDict. Show how to use it.",
    ),
    Prompt(
        "code-3",
        "code",
        "Write a Python script that reads a CSV file of sales (date, region, "
        "amount) and prints the total amount per region, sorted from largest to smallest.",
    ),
    Prompt(
        "math-1",
        "math",
        "A train leaves at 9:40 and travels 210 km at 84 km/h. At what time does it arrive? Explain each step.",
    ),
    Prompt("math-2", "math", "Solve for x: 3(x - 4) + 7 = 2x + 9. Show your work step by step, then check the answer."),
    Prompt(
        "math-3",
        "math",
        "A shop sells pencils at 3 for $0.75 and erasers at $0.40 each. How "
        "much do 12 pencils and 5 erasers cost? Explain.",
    ),
    Prompt("prose-1", "prose", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    Prompt(
        "prose-2", "prose", "Explain how a refrigerator keeps food cold, for someone with no background in physics."
    ),
    Prompt(
        "prose-3",
        "prose",
        "Write a friendly email inviting your neighbours to a community garden clean-up on Saturday morning.",
    ),
)


_SCORES = """def load_scores(path):
    scores = {}
    with open(path) as f:
        for line in f:
            name, value = line.strip().split(",")
            scores[name] = int(value)
    return scores


def best_player(scores):
    top = None
    for name, value in scores.items():
        if top is None or value > scores[top]:
            top = name
    return top
"""
_INVENTORY = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count
"""
_TEMPS = """def celsius_to_fahrenheit(c):
    return c * 9 / 5 + 32


def fahrenheit_to_celsius(f):
    return (f - 32) * 5 / 9


def describe(temp_c):
    if temp_c < 0:
        return "freezing"
    if temp_c < 20:
        return "mild"
    return "warm"
"""
_DURATION = """def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600}
    total = 0
    number = ""
    for ch in text:
        if ch.isdigit():
            number += ch
        elif ch in units:
            total += int(number) * units[ch]
            number = ""
    return total
"""
_PACKAGE = """{
  "name": "garden-tools",
  "version": "1.4.2",
  "description": "Small helpers for planning a vegetable garden",
  "license": "MIT",
  "dependencies": {
    "requests": "2.31",
    "pyyaml": "6.0"
  }
}
"""
_SHAPES = """import math


class Circle:
    def __init__(self, radius):
        self.radius = radius

    def area(self):
        return math.pi * self.radius ** 2

    def perimeter(self):
        return 2 * math.pi * self.radius


class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def perimeter(self):
        return 2 * (self.width + self.height)


def total_area(shapes):
    total = 0
    for shape in shapes:
        total += shape.area()
    return total
"""
_SETTINGS = """[server]
host = 127.0.0.1
port = 8080
workers = 4
timeout = 30

[database]
name = orders
user = shop
pool_size = 10

[logging]
level = info
file = server.log
"""


def _edit(pid: str, file: str, ask: str, lang: str = "python") -> Prompt:
    """A two-turn agent edit: the file handed over, acknowledged, then the change asked for."""
    return Prompt(
        pid,
        "agent",
        messages=(
            {"role": "user", "content": f"Here is my file:\n```{lang}\n{file}```"},
            {"role": "assistant", "content": "Thanks, I have read the file. What would you like me to change?"},
            {"role": "user", "content": ask},
        ),
    )


def _one(pid: str, ask: str, file: str, lang: str = "python") -> Prompt:
    """A one-turn agent edit: the change asked for with the file below it."""
    return Prompt(pid, "agent", messages=({"role": "user", "content": f"{ask}\n```{lang}\n{file}```"},))


AGENT = (
    _edit("agent-1", _SCORES, "Add a one-line docstring to each function. Reply with the complete file."),
    _edit(
        "agent-2",
        _INVENTORY,
        "Add a method `count(self, name)` that returns how many of an item there are. Reply with the whole class.",
    ),
    _one(
        "agent-3",
        "Add a method `total(self)` returning the sum of all counts to this class. Reply with the whole class.",
        _INVENTORY,
    ),
    _one(
        "agent-4",
        "Rename the function describe to classify in this file. Repeat the whole file with only that change.",
        _TEMPS,
    ),
    _one(
        "agent-5",
        "Add type hints to this function. Output the whole function with the hints and nothing else.",
        _DURATION,
    ),
    _one(
        "agent-6",
        'Change the version to 1.5.0 and add "click": "8.1" to the dependencies. Reply with the complete JSON.',
        _PACKAGE,
        "json",
    ),
    # verbatim re-emission of a longer file with a small change (long copying replies)
    _edit("agent-7", _SHAPES, "Rename the function total_area to sum_areas. Reply with the complete file."),
    _edit(
        "agent-8",
        _SETTINGS,
        "Change the port to 9090 and the log level to debug. Reply with the complete file, unchanged otherwise.",
        "ini",
    ),
)
BUILTIN = BUILTIN + AGENT


def builtin_prompts(kinds: tuple[str, ...] | None = None, per_kind: int | None = None) -> list[Prompt]:
    """The built-in set, optionally only some kinds and the first ``per_kind`` of each."""
    kinds = KINDS if not kinds else tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise BadRequest(f"unknown prompt kind(s) {bad}; choose from {', '.join(KINDS)}")
    out = []
    for kind in kinds:
        of_kind = [p for p in BUILTIN if p.kind == kind]
        out.extend(of_kind[:per_kind] if per_kind else of_kind)
    return out


def interleave(prompts: list[Prompt]) -> list[Prompt]:
    """code-1, math-1, prose-1, code-2, ...: every prefix is a balanced mix."""
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    out = []
    for i in range(max((len(v) for v in by_kind.values()), default=0)):
        out.extend(v[i] for v in by_kind.values() if i < len(v))
    return out


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file (see the module docstring)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise BadRequest(f"cannot read prompts file {path}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadRequest(f"{path}:{n}: not JSON: {e}") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if isinstance(obj, dict) and "prompt" not in obj and isinstance(obj.get("text"), str):
            obj = {**obj, "prompt": obj["text"]}
        if not isinstance(obj, dict) or not (
            isinstance(obj.get("prompt"), str) or isinstance(obj.get("messages"), list)
        ):
            raise BadRequest(f"{path}:{n}: expected a string, or an object with 'prompt' (string) or 'messages' (list)")
        if isinstance(obj.get("prompt"), str) and not obj["prompt"].strip() and obj.get("messages") is None:
            raise BadRequest(f"{path}:{n}: empty prompt")
        msgs = obj.get("messages")
        pid = str(obj.get("id", f"line-{n}"))
        kind = obj.get("kind") or next((k for k in KINDS if pid.startswith(k + "-")), "user")
        out.append(
            Prompt(
                pid,
                str(kind),
                obj.get("prompt", ""),
                tuple(msgs) if msgs is not None else None,
                bool(obj.get("chat", True)),
            )
        )
    if not out:
        raise BadRequest(f"{path}: no prompts")
    return out
