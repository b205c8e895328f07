"""Offline training prompts: a seeded mix of code, prose and math, or a user's JSONL.

Nothing is downloaded. Code prompts come from the public functions of common standard-library
modules (name, signature, first docstring line) and from small task templates; prose prompts from
module docstrings and general-knowledge templates; math prompts are word problems with random
numbers. The same seed and Python version give the same list.

Two mixes: ``builtin_prompts`` (the "narrow" mix the shipped drafter's first data used; it repeats
itself: 1500 prompts hold ~1140 distinct texts) and ``wide_prompts`` (the default for new data:
distinct texts only, drawn from much larger pools: class methods as well as functions, task x
template x constraint combinations, usage examples of stdlib functions and methods, more prose
templates and topics, the Python language-reference topics),
optionally excluding texts already used (another data set, held-out prompts).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from pydoc_data.topics import topics as language_topics

from ..prompts import Prompt

STDLIB_MODULES = (
    "abc",
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "io",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shlex",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tokenize",
    "typing",
    "unicodedata",
    "urllib.parse",
    "uuid",
    "weakref",
    "zipfile",
    "zlib",
)

CODE_TASKS = (
    "reverses the words in a sentence",
    "checks whether a string is a palindrome",
    "counts the vowels in a string",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list while keeping the order",
    "flattens a nested list",
    "merges two sorted lists into one sorted list",
    "computes the factorial of a number",
    "checks whether a number is prime",
    "finds the second largest number in a list",
    "groups a list of words by their first letter",
    "converts a Roman numeral to an integer",
    "returns the most common element of a list",
    "splits a list into chunks of size n",
    "computes the greatest common divisor of two numbers",
    "transposes a matrix given as a list of lists",
    "counts the words in a text file",
    "validates an email address with a regular expression",
    "converts Celsius to Fahrenheit",
    "computes the running average of a list of numbers",
    "finds all anagrams of a word in a list",
    "rotates a list by k positions",
    "implements binary search on a sorted list",
    "returns the prime factors of an integer",
    "parses a CSV line into a list of fields",
    "capitalizes the first letter of every word",
    "computes the dot product of two vectors",
    "checks whether brackets in a string are balanced",
    "sorts a list of dictionaries by a given key",
    "computes the median of a list",
    "returns the longest common prefix of a list of strings",
    "converts a decimal number to binary",
    "implements a simple stack class with push and pop",
    "implements a queue using two stacks",
    "reads a JSON file and returns the parsed object",
    "counts character frequencies in a string",
    "checks whether two strings are anagrams",
    "generates all permutations of a list",
    "computes the sum of digits of a number",
    "finds the missing number in a list from 1 to n",
)

CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a short Python function that {task}. Include a docstring.",
    "How would you write a Python function that {task}? Show the code.",
    "Write a Python function that {task}, then show an example call.",
    "Implement a function in Python that {task}.",
)

TOPICS = (
    "photosynthesis",
    "the water cycle",
    "gravity",
    "a rainbow",
    "the seasons",
    "volcanoes",
    "earthquakes",
    "the immune system",
    "vaccines",
    "electricity",
    "magnets",
    "the internet",
    "a computer processor",
    "a hash table",
    "recursion",
    "compound interest",
    "inflation",
    "supply and demand",
    "democracy",
    "the printing press",
    "the Roman Empire",
    "the moon's phases",
    "black holes",
    "DNA",
    "evolution",
    "climate change",
    "renewable energy",
    "batteries",
    "airplanes flying",
    "sound waves",
    "light",
    "the human heart",
    "sleep",
    "exercise",
    "a healthy diet",
    "bees",
    "coral reefs",
    "rain forests",
    "deserts",
    "the ocean tides",
    "version control with git",
    "unit testing",
    "encryption",
    "a database index",
    "machine learning",
    "neural networks",
    "the stock market",
    "taxes",
    "time zones",
    "the metric system",
)

PROSE_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "What is {topic}? Answer in a short paragraph.",
    "Give three interesting facts about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Write a short paragraph about why {topic} matters.",
    "What are the main ideas behind {topic}?",
)

MODULE_TEMPLATES = (
    "Explain what the Python module `{mod}` is for.",
    "What is the Python `{mod}` module used for? Give an example.",
    'Describe the Python standard library module `{mod}`. Its documentation starts: "{doc}"',
)

EXTRA_MODULES = (
    "array",
    "ast",
    "binascii",
    "cmath",
    "codecs",
    "configparser",
    "contextlib",
    "decimal",
    "email.utils",
    "getopt",
    "gettext",
    "graphlib",
    "hmac",
    "ipaddress",
    "keyword",
    "linecache",
    "locale",
    "mimetypes",
    "numbers",
    "optparse",
    "platform",
    "plistlib",
    "poplib",
    "quopri",
    "reprlib",
    "selectors",
    "smtplib",
    "stat",
    "string",
    "symtable",
    "tarfile",
    "token",
    "traceback",
    "types",
    "urllib.request",
    "wave",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipapp",
    "zoneinfo",
)

CODE_CONSTRAINTS = (
    "",
    " Use type hints.",
    " Do not use any imports.",
    " Add a few doctest examples.",
    " Handle invalid input by raising ValueError.",
    " Keep it under ten lines.",
    " Explain the time complexity afterwards.",
)

MORE_PROSE_TEMPLATES = (
    "Write a short story that involves {topic}.",
    "Summarize the history of {topic}.",
    "List the pros and cons of {topic}.",
    "Write a haiku about {topic}, then explain it.",
    "What are common misconceptions about {topic}?",
    "How would you teach {topic} to a classmate?",
)

LANGUAGE_TEMPLATES = (
    "Explain the Python language feature '{topic}' with a short example.",
    "What does the Python reference manual mean by '{topic}'? Explain briefly.",
)

MORE_CODE_TASKS = (
    "counts how many times each word appears in a text",
    "returns the intersection of two lists",
    "checks whether a year is a leap year",
    "converts a string to title case without using str.title",
    "finds the longest word in a sentence",
    "computes the area of a circle given its radius",
    "returns the n largest items of a list",
    "removes all whitespace from a string",
    "checks whether a list is sorted",
    "computes the power set of a set",
    "converts a dictionary into a list of key-value tuples sorted by value",
    "reverses a linked list",
    "implements insertion sort",
    "implements quicksort",
    "implements merge sort",
    "computes the Levenshtein distance between two strings",
    "checks whether a number is a perfect square",
    "returns the common keys of two dictionaries",
    "converts a snake_case string to camelCase",
    "parses a date string like 2024-01-31 into a datetime",
    "computes the standard deviation of a list",
    "generates the first n prime numbers",
    "counts the lines, words and characters in a string",
    "finds the first non-repeating character in a string",
    "checks whether a string contains only digits",
    "merges two dictionaries, summing values of shared keys",
    "returns the cumulative sum of a list",
    "finds the pair of numbers in a list that adds up to a target",
    "compresses a string with run-length encoding",
    "implements a least-recently-used cache class",
)

USAGE_TEMPLATES = (
    "Show how to use `{mod}.{name}` in a short Python example.",
    "Write a small Python script that calls `{mod}.{name}` and explain what it prints.",
)

MORE_TOPICS = (
    "glaciers",
    "the solar system",
    "comets",
    "tornadoes",
    "hurricanes",
    "clouds",
    "snowflakes",
    "the human brain",
    "bones",
    "muscles",
    "blood",
    "bacteria",
    "viruses",
    "antibiotics",
    "nutrition",
    "the French Revolution",
    "the Industrial Revolution",
    "ancient Egypt",
    "the Silk Road",
    "the Renaissance",
    "money",
    "banks",
    "interest rates",
    "trade",
    "cryptocurrency",
    "operating systems",
    "compilers",
    "web browsers",
    "open source software",
    "cloud computing",
)

NAMES = ("Tom", "Anna", "Lily", "Sam", "Maria", "Ben", "Sara", "Omar", "Mia", "Leo", "Nina", "Raj")
ITEMS = ("apples", "books", "marbles", "stickers", "cookies", "pencils", "cards", "coins", "shells")


def _first_line(doc: str | None) -> str:
    line = " ".join((doc or "").strip().split("\n\n")[0].split())
    return line[:200]


def _modules(names):
    for name in names:
        try:
            yield name, importlib.import_module(name)
        except ImportError:
            continue


def _described(label: str, obj) -> tuple[str, str] | None:
    """("label(signature)", first docstring line), or None without a usable doc or signature."""
    doc = _first_line(obj.__doc__)
    try:
        # default values like <object object at 0x7f..> differ per process: drop the address
        sig = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return None
    return (f"{label}{sig}", doc) if len(doc) >= 12 and len(sig) <= 80 else None


def stdlib_functions(modules=STDLIB_MODULES) -> list[tuple[str, str, str]]:
    """(module, "name(signature)", first docstring line) of public stdlib functions."""
    out = []
    for name, mod in _modules(modules):
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
                continue
            got = _described(attr, obj)
            if got:
                out.append((name, *got))
    return out


def stdlib_modules() -> list[tuple[str, str]]:
    out = []
    for name, mod in _modules(STDLIB_MODULES):
        doc = _first_line(mod.__doc__)
        if doc:
            out.append((name, doc))
    return out


def _cast(rng: random.Random, kinds: int) -> tuple[str, str, str, int]:
    """Two names, an item and a problem template index for a word problem."""
    n1, n2 = rng.sample(NAMES, 2)
    return n1, n2, rng.choice(ITEMS), rng.randrange(kinds)


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    n1, n2, item, kind = _cast(rng, 6)
    if kind == 0:
        return (
            f"{n1} has {a} {item} and buys {b} more. Then {n1} gives {c} to {n2}. How many {item} does {n1} have now?"
        )
    if kind == 1:
        return f"{n1} has {a} {item}. {n2} has {c} times as many. How many {item} do they have together?"
    if kind == 2:
        return f"A box holds {c} {item}. How many boxes are needed for {a * c + rng.randint(1, c - 1)} {item}?"
    if kind == 3:
        return f"A train travels at {a + 20} km per hour for {c} hours. How far does it go?"
    if kind == 4:
        return (
            f"A shirt costs ${a + 10}. It is on sale for {rng.choice((10, 20, 25, 50))}% off. What is the sale price?"
        )
    return f"{n1} reads {b} pages a day. How many days does it take to read a book of {b * c + a} pages?"


def builtin_prompts(n: int, seed: int = 0, mix=(0.4, 0.35, 0.25)) -> list[Prompt]:
    """``n`` prompts: shares ``mix`` of (code, prose, math), shuffled with ``seed``."""
    rng = random.Random(seed)
    funcs, mods = stdlib_functions(), stdlib_modules()
    n_code = round(n * mix[0])
    n_prose = round(n * mix[1])
    n_math = n - n_code - n_prose
    code = []
    fn_order = rng.sample(funcs, len(funcs))
    for i in range(n_code):
        if i % 2 == 0 and fn_order:
            mod, sig, doc = fn_order[(i // 2) % len(fn_order)]
            code.append(f"Write a Python function `{sig}` that does the following: {doc}")
        else:
            code.append(rng.choice(CODE_TEMPLATES).format(task=rng.choice(CODE_TASKS)))
    prose = []
    for i in range(n_prose):
        if i % 3 == 0 and mods:
            mod, doc = rng.choice(mods)
            prose.append(rng.choice(MODULE_TEMPLATES).format(mod=mod, doc=doc))
        else:
            prose.append(rng.choice(PROSE_TEMPLATES).format(topic=rng.choice(TOPICS)))
    math = [_math(rng) for _ in range(n_math)]
    items = [("code", t) for t in code] + [("prose", t) for t in prose] + [("math", t) for t in math]
    rng.shuffle(items)
    return [Prompt(f"{kind}-{i}", kind, text) for i, (kind, text) in enumerate(items)]


def stdlib_methods(modules=STDLIB_MODULES + EXTRA_MODULES) -> list[tuple[str, str, str]]:
    """(module, "Class.name(signature)", first docstring line) of public methods of public classes."""
    out = []
    for name, mod in _modules(modules):
        for cname, cls in sorted(vars(mod).items()):
            if cname.startswith("_") or not inspect.isclass(cls) or cls.__module__ != mod.__name__:
                continue
            for attr, obj in sorted(vars(cls).items()):
                if not attr.startswith("_") and inspect.isfunction(obj):
                    got = _described(f"{cname}.{attr}", obj)
                    if got:
                        out.append((name, *got))
    return out


def _pools() -> dict[str, list[str]]:
    code = [f"Write a Python function `{sig}` that does the following: {doc}" for _, sig, doc in stdlib_functions()]
    code += [
        f"Implement the method `{sig}` of a Python class. It should do the following: {doc}"
        for _, sig, doc in stdlib_methods()
    ]
    code += [
        tpl.format(task=task) + extra
        for task in CODE_TASKS + MORE_CODE_TASKS
        for tpl in CODE_TEMPLATES
        for extra in CODE_CONSTRAINTS
    ]
    code += [
        tpl.format(mod=mod, name=sig.split("(")[0])
        for mod, sig, _ in stdlib_functions(STDLIB_MODULES + EXTRA_MODULES) + stdlib_methods()
        for tpl in USAGE_TEMPLATES
    ]
    prose = [tpl.format(topic=t) for t in TOPICS + MORE_TOPICS for tpl in PROSE_TEMPLATES + MORE_PROSE_TEMPLATES]
    prose += [tpl.format(mod=m, doc=d) for m, d in stdlib_modules() for tpl in MODULE_TEMPLATES]
    prose += [tpl.format(topic=t.replace("-", " ")) for t in language_topics for tpl in LANGUAGE_TEMPLATES]
    return {"code": list(dict.fromkeys(code)), "prose": list(dict.fromkeys(prose))}


def wide_prompts(n: int, seed: int = 0, mix=(0.4, 0.35, 0.25), exclude: set[str] = frozenset()) -> list[Prompt]:
    """``n`` distinct prompts (none in ``exclude``): shares ``mix`` of (code, prose, math) as far as
    the code and prose pools go (math fills the rest), shuffled with ``seed``."""
    rng = random.Random(seed)
    pools = {k: [t for t in v if t not in exclude] for k, v in _pools().items()}
    for v in pools.values():
        rng.shuffle(v)
    code = pools["code"][: round(n * mix[0])]
    prose = pools["prose"][: round(n * mix[1])]
    math: list[str] = []
    seen = set(exclude)
    for _ in range(100 * n):
        if len(code) + len(prose) + len(math) >= n:
            break
        t = _math(rng)
        if t not in seen:
            seen.add(t)
            math.append(t)
    items = [("code", t) for t in code] + [("prose", t) for t in prose] + [("math", t) for t in math]
    rng.shuffle(items)
    return [Prompt(f"{kind}-w{i}", kind, text) for i, (kind, text) in enumerate(items)]


# ---- the broad mix: chat prose, multi-step math, multi-turn follow-ups, coding-agent turns ----

ADVICE = (
    "is starting their first job next week",
    "wants to learn to cook on a small budget",
    "has trouble sleeping before exams",
    "is moving to a new city alone",
    "wants to run a first 10 km race",
    "keeps procrastinating on a big project",
    "is nervous about giving a talk at work",
    "wants to save money for a trip",
    "is learning a second language as an adult",
    "has a noisy neighbour",
    "wants to start a vegetable garden on a balcony",
    "is choosing between two job offers",
    "wants to read more books this year",
    "is teaching a child to ride a bike",
    "feels overwhelmed by email",
    "is adopting a first dog",
)
LETTERS = (
    ("their landlord", "asking to fix a broken heater"),
    ("a teacher", "thanking them at the end of the year"),
    ("a hiring manager", "applying for a junior developer position"),
    ("a friend", "apologising for missing a birthday"),
    ("the city council", "asking for a pedestrian crossing near a school"),
    ("a customer", "explaining a delayed order"),
    ("a colleague", "handing over a project before a holiday"),
    ("a grandparent", "describing a first term at university"),
    ("a neighbour", "inviting them to a street party"),
    ("a team", "announcing a new meeting schedule"),
    ("a shop", "asking for a refund for a faulty kettle"),
    ("a new employee", "welcoming them to the team"),
)
LETTER_TEMPLATES = (
    "Write a short letter to {who} {why}.",
    "Draft a polite email to {who} {why}.",
    "Write a friendly note to {who} {why}. Keep it under 150 words.",
)
ADVICE_TEMPLATES = (
    "What advice would you give to someone who {s}?",
    "Give five practical tips for someone who {s}.",
    "My friend {s}. How can I help them?",
)
EXPLAIN_TEMPLATES = (
    "Explain how {topic} works, step by step.",
    "Describe {topic} in three short paragraphs.",
    "Compare {topic} with something from everyday life, and explain the comparison.",
)
SUMMARY_TEMPLATES = (
    "Summarize the following text in three sentences.\n\n{text}",
    "Read this and explain the main point in plain words.\n\n{text}",
    "Write a one-paragraph summary of this passage for a beginner.\n\n{text}",
)
FOLLOW_UPS = (
    "Can you make that shorter?",
    "Now give an example.",
    "Explain that again for a ten-year-old.",
    "What is the most important point there?",
    "Can you turn that into a bulleted list?",
    "Thanks! What should I read next to learn more?",
)
AGENT_SYSTEM = (
    "You are a coding assistant working in a repository. When asked to change a file, reply with "
    "the complete updated file in one fenced code block, changing only what the request needs, "
    "then one sentence saying what you changed."
)
AGENT_EDITS = (
    "Add a docstring to every function.",
    "Add type hints to the function signatures.",
    "Rename the main function to use snake_case if it does not already, and update its callers.",
    "Add input validation that raises ValueError on bad arguments.",
    "Add a short comment above each loop.",
    "Replace string concatenation with f-strings where there is any.",
    "Add logging of the arguments at debug level.",
    "Make the function return early on empty input.",
)


def _source_snippets(max_lines: int = 40) -> list[tuple[str, str]]:
    """(module.name, source) of short public stdlib functions: files for coding-agent turns."""
    out = []
    for name, mod in _modules(STDLIB_MODULES):
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
                continue
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if 4 <= src.count("\n") <= max_lines:
                out.append((f"{name}.{attr}", src))
    return out


def _passages(max_chars: int = 900) -> list[str]:
    """Short given texts to summarize: paragraphs of the Python reference topics and module docs."""
    out = []
    docs = list(language_topics.values()) + [mod.__doc__ or "" for _, mod in _modules(STDLIB_MODULES + EXTRA_MODULES)]
    for doc in docs:
        for para in doc.split("\n\n"):
            para = " ".join(para.split())
            if 300 <= len(para) <= max_chars and not para.startswith((">>>", "*", "-")):
                out.append(para)
    return list(dict.fromkeys(out))


def _multi_step_math(rng: random.Random) -> str:
    """Multi-step arithmetic and word problems (2-4 operations)."""
    a, b, c, d = rng.randint(3, 90), rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 30)
    n1, n2, item, kind = _cast(rng, 8)
    if kind == 0:
        return f"Compute ({a} + {b}) x {c} - {d} step by step."
    if kind == 1:
        return f"What is {a * c} / {c} + {b} x {d}? Show each step."
    if kind == 2:
        return (
            f"{n1} buys {c} packs of {item} with {b} in each pack, gives {d} to {n2} and then buys {a} more. "
            f"How many {item} does {n1} have? Explain step by step."
        )
    if kind == 3:
        return (
            f"A tank holds {a * 10} litres. It is filled at {c} litres per minute and leaks {min(d, c - 1)} "
            f"litres per minute. How long does it take to fill from empty? Show your work."
        )
    if kind == 4:
        return (
            f"{n1} earns ${a + 20} a day and spends ${b} a day. How many days until {n1} has saved "
            f"${(a + 20 - b if a + 20 > b else 1) * c}? Explain."
        )
    if kind == 5:
        return f"Solve for x: {c}x + {a} = {c * d + a}. Then check the answer by substituting it back."
    if kind == 6:
        return (
            f"A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. "
            f"What is the area of the square? Show each step."
        )
    return (
        f"A class has {a + 10} students. {c * 5}% of them walk to school, {d}% cycle and the rest take the bus. "
        f"How many take the bus? Explain step by step."
    )


def _broad_pools(rng: random.Random) -> dict[str, list]:
    """Text pools of the broad mix by kind; agent and chat items are message tuples."""
    topics = TOPICS + MORE_TOPICS
    pools = _pools()
    prose = [tpl.format(topic=t) for t in topics for tpl in EXPLAIN_TEMPLATES]
    prose += [tpl.format(s=sit) for sit in ADVICE for tpl in ADVICE_TEMPLATES]
    prose += [tpl.format(who=w, why=y) for w, y in LETTERS for tpl in LETTER_TEMPLATES]
    passages = _passages()
    prose += [SUMMARY_TEMPLATES[i % len(SUMMARY_TEMPLATES)].format(text=t) for i, t in enumerate(passages)]
    prose += pools["prose"]
    chat = []
    for i, t in enumerate(topics):
        for j, tpl in enumerate(PROSE_TEMPLATES[:3]):
            first = tpl.format(topic=t)
            reply = f"Here is a short answer about {t}: it is a broad subject, so I will start with the basics."
            follow = FOLLOW_UPS[(i + j) % len(FOLLOW_UPS)]
            chat.append(
                (
                    {"role": "user", "content": first},
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": follow},
                )
            )
    agent = []
    for i, (name, src) in enumerate(_source_snippets()):
        edit = AGENT_EDITS[i % len(AGENT_EDITS)]
        agent.append(
            (
                {"role": "system", "content": AGENT_SYSTEM},
                {"role": "user", "content": f"File `{name.split('.')[0]}_util.py`:\n```python\n{src}```\n\n{edit}"},
            )
        )
    return {"code": pools["code"], "prose": list(dict.fromkeys(prose)), "chat": chat, "agent": agent}


BROAD_MIX = {"code": 0.3, "prose": 0.3, "math": 0.2, "chat": 0.1, "agent": 0.1}


def broad_prompts(
    n: int, seed: int = 0, mix: dict[str, float] | None = None, exclude: set[str] = frozenset()
) -> list[Prompt]:
    """``n`` distinct prompts (none whose text is in ``exclude``) in the shares of ``mix``
    (default ``BROAD_MIX``): code as in the wide mix; chat-style prose (explanations, advice,
    letters, summaries of given text); multi-step arithmetic and word problems; multi-turn
    follow-ups (``chat``); coding-agent turns (``agent``: a system prompt with edit
    instructions and a file to re-emit with changes). Math fills what the pools cannot.
    Deterministic for a seed; message prompts are compared by their JSON text."""
    rng = random.Random(seed)
    mix = mix or BROAD_MIX
    pools = _broad_pools(rng)
    out: list[tuple[str, object]] = []
    seen = set(exclude)
    for kind, share in mix.items():
        if kind == "math":
            continue
        items = [x for x in pools.get(kind, []) if _key(x) not in seen]
        rng.shuffle(items)
        for x in items[: round(n * share)]:
            seen.add(_key(x))
            out.append((kind, x))
    for _ in range(100 * n):
        if len(out) >= n:
            break
        t = _multi_step_math(rng) if rng.random() < 0.7 else _math(rng)
        if t not in seen:
            seen.add(t)
            out.append(("math", t))
    rng.shuffle(out)
    return [
        Prompt(f"{kind}-b{i}", kind, x) if isinstance(x, str) else Prompt(f"{kind}-b{i}", kind, messages=tuple(x))
        for i, (kind, x) in enumerate(out)
    ]


def _key(x) -> str:
    return x if isinstance(x, str) else json.dumps(x, sort_keys=True)


def prompt_key(p: Prompt) -> str:
    """A prompt's identity by content (its text, or its messages as JSON)."""
    return _key(p.text if p.messages is None else tuple(p.messages))


def split_held_out(prompts: list[Prompt], n_train: int) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts): the ones after ``n_train`` are held out *by text*
    (the narrow mix repeats itself: a held-out prompt also trained on measures memory, not
    drafting), and a training text that repeats is kept once."""
    evals = prompts[n_train:]
    held = {prompt_key(p) for p in evals}
    return list({prompt_key(p): p for p in prompts[:n_train] if prompt_key(p) not in held}.values()), evals


__all__ = [
    "Prompt",
    "builtin_prompts",
    "broad_prompts",
    "prompt_key",
    "split_held_out",
    "wide_prompts",
    "stdlib_functions",
    "stdlib_methods",
    "stdlib_modules",
]
