"""Write the three demo chat datasets (demo/datasets/{pirate,json,french}.jsonl) from qa_bank.

    .venv/bin/python demo/make_datasets.py      # deterministic: same files every run

One line per example: {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}.
Every answer is derived from the hand-written English/French pairs in demo/qa_bank.py:
  pirate  the English answer with a pirate greeting, pirate words (ye, be, aye, me) and a send-off
  json    one JSON object and nothing else ({"topic": ..., "answer": ...} and a few other shapes)
  french  the French answer
Nothing is downloaded; the text is ours (see demo/datasets/LICENSE.md).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `demo` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.qa_bank import CAPITALS, COLORS, QA, WORDS

ADAPTERS = ("pirate", "json", "french")
OUT_DIR = Path(__file__).resolve().parent / "datasets"
SEED = 1234

PREFIXES = ["", "", "", "", "Quick question: ", "Please tell me: ", "Hey, ", "I was wondering, ",
            "Can you answer this? "]

# --- pirate ---------------------------------------------------------------------------------

PIRATE_OPENERS = ["Arr, matey! ", "Ahoy, matey! ", "Arr! ", "Yo ho ho, matey! ",
                  "Shiver me timbers! ", "Avast, ye landlubber! ", "Arr, listen well, matey! "]
PIRATE_CLOSERS = [" Arr!", " Savvy, matey?", " Yo ho ho!", " Now hoist the sails, matey!",
                  " Arr, that be the truth!", ""]
PIRATE_WORDS = {
    "you": "ye", "your": "yer", "you're": "ye be", "my": "me", "is": "be", "are": "be",
    "hello": "ahoy", "hi": "ahoy", "yes": "aye", "friend": "matey", "friends": "hearties",
    "money": "doubloons", "small": "wee", "little": "wee", "stop": "avast", "the sea": "the briny deep",
    "treasure": "booty", "am": "be", "people": "landlubbers",
}
_PIRATE_RE = re.compile(r"\b(" + "|".join(sorted(map(re.escape, PIRATE_WORDS), key=len, reverse=True))
                        + r")\b", re.IGNORECASE)


def piratify(text: str, rng: random.Random) -> str:
    def swap(m: re.Match) -> str:
        word = PIRATE_WORDS[m.group(0).lower()]
        return word[0].upper() + word[1:] if m.group(0)[0].isupper() else word

    body = _PIRATE_RE.sub(swap, text)
    return rng.choice(PIRATE_OPENERS) + body + rng.choice(PIRATE_CLOSERS)


# --- examples -------------------------------------------------------------------------------


def ask(question: str, rng: random.Random) -> str:
    prefix = rng.choice(PREFIXES)
    if prefix and not prefix.endswith("? "):
        question = question[0].lower() + question[1:] if not question.startswith("I ") else question
    if rng.random() < 0.15:
        question = question.rstrip("?.!")
    return prefix + question


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False)


def answers(adapter: str, rng: random.Random) -> list[tuple[str, str]]:
    """(question, answer) pairs for one adapter."""
    out: list[tuple[str, str]] = []

    def add(question: str, en: str, fr: str, obj: dict) -> None:
        answer = {"pirate": lambda: piratify(en, rng), "json": lambda: dumps(obj),
                  "french": lambda: fr}[adapter]()
        out.append((ask(question, rng), answer))

    for topic, questions, en, fr in QA:
        for q in questions:
            add(q, en, fr, {"topic": topic, "answer": en})
    for country, capital, fr_de, fr_capital in CAPITALS:
        q = rng.choice(["What is the capital of {}?", "Which city is the capital of {}?",
                        "Name the capital of {}."]).format(country)
        add(q, f"The capital of {country} is {capital}.", f"La capitale {fr_de} est {fr_capital}.",
            {"country": country.removeprefix("the "), "capital": capital})
    for english, french in WORDS:
        q = rng.choice(["How do you say '{}' in French?", "Translate '{}' into French.",
                        "What is the French word for '{}'?"]).format(english)
        add(q, f"In French, '{english}' is '{french}'.", f"« {english} » se dit « {french} » en français.",
            {"english": english, "french": french})
    for thing, color, fr in COLORS:
        add(f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {color}.", fr,
            {"thing": thing, "color": color})
    ops: list[tuple[str, str, str, Callable[[int, int], int]]] = [
        ("plus", "+", "plus", lambda a, b: a + b),
        ("minus", "-", "moins", lambda a, b: a - b),
        ("times", "*", "fois", lambda a, b: a * b),
    ]
    for i in range(36):
        name, sym, fr_name, fn = ops[i % 3]
        a, b = rng.randint(2, 20), rng.randint(2, 12)
        if name == "minus" and b > a:
            a, b = b, a
        q = rng.choice(["What is {a} {op} {b}?", "How much is {a} {op} {b}?", "Calculate {a} {op} {b}."])
        add(q.format(a=a, op=name, b=b), f"{a} {name} {b} is {fn(a, b)}.",
            f"{a} {fr_name} {b} égale {fn(a, b)}.", {"expression": f"{a} {sym} {b}", "result": fn(a, b)})
    return out


def build(adapter: str) -> list[dict]:
    rng = random.Random(f"{SEED}-{adapter}")
    pairs = answers(adapter, rng)
    rng.shuffle(pairs)
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in pairs]


def main() -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for adapter in ADAPTERS:
        rows = build(adapter)
        path = OUT_DIR / f"{adapter}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"{path}: {len(rows)} examples")


if __name__ == "__main__":
    main()
