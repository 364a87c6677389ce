"""Write the bench sets where copying pays: grounded.jsonl, multiturn.jsonl and agentic.jsonl.

Their text comes from two places only: the CPython standard library of the running interpreter (module and
function docstrings and the source of pure-Python functions; PSF License 2.0) and what this script writes
itself (questions, instructions, scripted assistant turns, tool schemas and requests; Apache-2.0, like the
project).  The files in ``hetero_spec/bench/data`` were made with CPython 3.11; another version's docstrings
may differ slightly, so rerun only to regenerate on purpose:

    python scripts/make_suffix_sets.py [--out hetero_spec/bench/data]

Each line: ``question_id``, ``category`` and ``turns`` (one user turn; the bench renders it in the chat
template) or, for the multi-turn set, ``messages`` (the whole conversation, whose last turn is the user's).
"""
from __future__ import annotations

import argparse
import inspect
import json
import textwrap
from pathlib import Path

SUMMARISE = ["argparse", "json", "csv", "heapq", "copy", "timeit", "unittest", "hashlib", "plistlib",
             "http.cookies"]

# (dotted function, question answered by its docstring)
PASSAGES = [
    ("json.dumps", "What does the function do when ``sort_keys`` is true?"),
    ("json.loads", "Which types can the input ``s`` be?"),
    ("textwrap.wrap", "What does the function return, and how long can each line be?"),
    ("shutil.copytree", "What happens when ``dirs_exist_ok`` is false and the destination already exists?"),
    ("subprocess.run", "What does the ``check`` argument do?"),
    ("heapq.merge", "What does the ``key`` argument do, and what does ``reverse`` do?"),
    ("difflib.get_close_matches", "What are the arguments ``n`` and ``cutoff`` for, and what are their defaults?"),
    ("os.makedirs", "What does ``exist_ok`` change?"),
    ("functools.lru_cache", "What happens when ``maxsize`` is set to None?"),
    ("itertools.groupby", "What is the key function's default?"),
    ("statistics.median", "What is returned when the number of data points is even?"),
    ("tempfile.mkstemp", "Who is responsible for deleting the file?"),
]

# (dotted function, edit instruction)
EDITS = [
    ("textwrap.dedent", "Rename the variable ``margin`` to ``common_prefix`` everywhere."),
    ("string.capwords", "Add type hints to the signature."),
    ("colorsys.rgb_to_hsv", "Rename the variables ``maxc`` and ``minc`` to ``high`` and ``low``."),
    ("calendar.isleap", "Add a doctest example to the docstring."),
    ("fnmatch.filter", "Replace the loops with a list comprehension where you can."),
    ("shlex.quote", "Add a comment above each return statement."),
    ("html.escape", "Add a keyword argument ``apostrophe`` (default True) that decides whether ' is escaped."),
    ("random.Random.shuffle", "Rename the parameter ``x`` to ``items``."),
    ("statistics.median_low", "Add type hints to the signature."),
    ("textwrap.indent", "Rename the parameter ``predicate`` to ``should_indent``."),
    ("base64.b64encode", "Rewrite the docstring in the imperative mood."),
    ("difflib.get_close_matches", "Raise the default cutoff to 0.7 and update the docstring to match."),
]


def resolve(dotted: str):
    """A function by its dotted name: a module (possibly dotted) then attributes (a class's method)."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def module_doc(name: str) -> str:
    import importlib

    return inspect.getdoc(importlib.import_module(name)) or ""


def grounded() -> list[dict]:
    out = []
    for name in SUMMARISE:
        doc = module_doc(name)
        out.append({"category": "summarise",
                    "turns": [f"Summarise the following documentation of the Python module `{name}` in a few "
                              f"sentences, keeping its terms.\n\n{doc}"]})
    for fn, question in PASSAGES:
        doc = inspect.getdoc(resolve(fn)) or ""
        out.append({"category": "passage_qa",
                    "turns": [f"Answer the question from the passage only, quoting it where you can.\n\n"
                              f"Passage (the documentation of `{fn}`):\n{doc}\n\nQuestion: {question}"]})
    for fn, instruction in EDITS:
        src = textwrap.dedent(inspect.getsource(resolve(fn)))
        out.append({"category": "edit_code",
                    "turns": [f"Edit this Python function. {instruction} Reply with the complete edited function "
                              f"in one code block.\n\n```python\n{src}```"]})
    return out


def _first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n")[0].replace("\n", " ")


LISTS = [
    ("groceries", ["apples", "brown bread", "eggs", "olive oil", "rice", "tomatoes", "yoghurt"], "milk", 3),
    ("packing list", ["passport", "charger", "toothbrush", "rain jacket", "sunglasses", "notebook"], "headphones", 2),
    ("reading list", ["Moby-Dick", "Middlemarch", "Don Quixote", "Dracula", "Emma", "Walden"], "Ulysses", 4),
    ("chores", ["water the plants", "vacuum the hall", "take out the recycling", "clean the oven",
                "change the bed sheets"], "defrost the freezer", 1),
    ("meeting agenda", ["welcome and introductions", "review of last quarter", "budget for next year",
                        "hiring plan", "office move", "any other business"], "security update", 5),
    ("garden tasks", ["prune the roses", "sow the carrots", "mow the lawn", "repair the fence", "weed the beds"],
     "compost the leaves", 2),
]

EMAILS = [
    "Hi Sam, the quarterly report is late again. I need it on my desk by Friday at noon, with the sales figures "
    "for all three regions and the notes from the client meetings. Let me know if anything is blocking you.",
    "Dear neighbours, the street party is on Saturday the 14th from two until eight. Please bring a dish to share "
    "and your own chairs. Cars must be moved off the street by one o'clock so the council can close the road.",
    "Hello team, from Monday the office opens at eight and closes at six. The kitchen will be cleaned on "
    "Wednesdays, so please take your food out of the fridge on Tuesday evening. Thanks for your help.",
    "Dear Ms Patel, thank you for your order of twelve blue mugs. Two arrived broken, so we are sending two "
    "replacements today by courier. You do not need to return the broken ones. We are sorry for the trouble.",
    "Hi all, the library will be closed for repairs from the third to the tenth of next month. Books due in that "
    "week can be returned on the eleventh without a fine, and the online catalogue stays open as usual.",
    "Dear parents, the school trip to the science museum leaves at half past eight on Thursday and comes back by "
    "four. Children need a packed lunch, a water bottle and a coat. The cost is twelve pounds per child.",
]

CODE_TURNS = ["textwrap.dedent", "string.capwords", "colorsys.rgb_to_hsv", "calendar.isleap", "fnmatch.filter",
              "html.escape", "statistics.median_low", "textwrap.indent", "heapq.nsmallest",
              "shlex.quote", "base64.b64encode", "heapq.nlargest"]


def multiturn() -> list[dict]:
    out = []
    for name, items, extra, after in LISTS:
        listed = "\n".join(f"{i}. {it}" for i, it in enumerate(items, 1))
        out.append({"category": "revise_list", "messages": [
            {"role": "user", "content": f"Write my {name} as a numbered list: {', '.join(items)}."},
            {"role": "assistant", "content": f"Here is your {name}:\n{listed}"},
            {"role": "user", "content": f"Add {extra} after item {after} and write out the whole list again."}]})
    for text in EMAILS:
        out.append({"category": "revise_text", "messages": [
            {"role": "user", "content": f"Fix any mistakes in this message and keep everything else the same:\n\n{text}"},
            {"role": "assistant", "content": f"Here is the message, unchanged except for small fixes:\n\n{text}"},
            {"role": "user", "content": "Make it friendlier, but keep every date, time and number exactly as it is. "
                                        "Write out the whole message."}]})
    for fn in CODE_TURNS:
        obj = resolve(fn)
        src = textwrap.dedent(inspect.getsource(obj))
        out.append({"category": "revise_code", "messages": [
            {"role": "user", "content": f"What does this function do?\n\n```python\n{src}```"},
            {"role": "assistant", "content": _first_paragraph(inspect.getdoc(obj) or "It is undocumented.")},
            {"role": "user", "content": "Now write the same function again with a comment on every line that "
                                        "does not have one. Show the whole function."}]})
    return out


TOOLS = [
    {"name": "get_weather", "parameters": {"city": "string", "unit": "celsius | fahrenheit"}},
    {"name": "convert_currency", "parameters": {"amount": "number", "from": "ISO code", "to": "ISO code"}},
    {"name": "create_event", "parameters": {"title": "string", "date": "YYYY-MM-DD", "time": "HH:MM",
                                            "attendees": "list of names"}},
    {"name": "search_flights", "parameters": {"origin": "IATA code", "destination": "IATA code",
                                              "date": "YYYY-MM-DD", "passengers": "integer"}},
]

REQUESTS = [
    "What's the weather like in Lisbon right now, in celsius?",
    "Convert 250 US dollars to euros.",
    "Book a meeting called Budget review on 2025-03-14 at 10:30 with Ana and Tom.",
    "Find flights from LHR to JFK on 2025-06-02 for two people.",
    "Is it cold in Oslo today? Give it to me in fahrenheit.",
    "How many Japanese yen is 80 British pounds?",
    "Put Dentist on my calendar for 2025-04-01 at 08:15, just me.",
    "Search flights from CDG to BCN on 2025-05-20 for one passenger.",
    "Tell me the weather in Nairobi in celsius.",
    "Convert 1200 Swiss francs into Canadian dollars.",
    "Create an event Team lunch on 2025-02-27 at 12:00 with Priya, Lee and Sara.",
    "I need flights from SFO to SEA on 2025-07-11 for four passengers.",
]

RECORD = {"name": "", "age": 0, "city": "", "occupation": "", "hobbies": []}
PEOPLE = [
    "Maria is a 34-year-old nurse from Porto who likes swimming and chess.",
    "Kenji, 52, teaches history in Osaka; he spends weekends fishing and baking bread.",
    "Aisha is a software engineer in Toronto. She is 28 and plays the violin and goes climbing.",
    "Pedro lives in Mexico City, works as a chef and is 41. He collects vinyl records.",
    "Eva is 67, a retired pilot living in Vienna, who paints and walks her dog every day.",
    "Tom is a 19-year-old student in Dublin who plays football and writes short stories.",
    "Lina, 45, is an architect in Beirut who enjoys gardening, cycling and photography.",
    "Omar works as a bus driver in Cairo. He is 38 and loves crosswords.",
    "Sofia is a 23-year-old dancer from Buenos Aires; in her free time she reads poetry.",
    "Henrik, 59, a carpenter in Bergen, builds model ships and sings in a choir.",
    "Grace is a 31-year-old lawyer in Nairobi who runs marathons and plays the piano.",
    "Wei is 26, a nurse in Chengdu, and likes hiking, cooking and video games.",
]


def agentic() -> list[dict]:
    tools = json.dumps(TOOLS, indent=1)
    out = [{"category": "tool_call", "turns": [
        f"You are an agent that answers by calling one tool. Tools:\n{tools}\n\nReply with one JSON object "
        f'{{"tool": <name>, "arguments": {{...}}}} and nothing else.\n\nRequest: {req}']} for req in REQUESTS]
    template = json.dumps(RECORD)
    out += [{"category": "fill_template", "turns": [
        f"Fill in this JSON record from the description. Keep the keys and their order, and reply with the JSON "
        f"only.\n\nRecord: {template}\n\nDescription: {person}"]} for person in PEOPLE]
    return out


def interleave(rows: list[dict]) -> list[dict]:
    """Categories in turn, so that the first N prompts of a set (``bench --n-prompts N``) cover each."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["category"], []).append(row)
    out, queues = [], list(groups.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def write(path: Path, rows: list[dict]) -> None:
    rows = interleave(rows)
    with path.open("w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"question_id": i, **row}, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(rows)} prompts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "hetero_spec/bench/data")
    out = parser.parse_args().out
    write(out / "grounded.jsonl", grounded())
    write(out / "multiturn.jsonl", multiturn())
    write(out / "agentic.jsonl", agentic())


if __name__ == "__main__":
    main()
