"""A synthetic prompt mix for self-distilling SmolLM2's drafters: code, chat and reasoning.

Every prompt is built here from templates and word lists, seeded, so the mix is reproducible and
shares nothing with public evaluation sets (MT-Bench, HumanEval, MBPP, GSM8K, MATH-500 and the
rest are never read). The target answers each prompt itself during training; these are only the
questions.

    python scripts/smollm2/prompts.py --count 4096 --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "C", "Java", "Ruby", "TypeScript"]
TASKS = [
    "reverses a string",
    "counts the vowels in a word",
    "returns the largest number in a list",
    "checks whether a number is prime",
    "removes duplicates from a list while keeping the order",
    "merges two sorted lists",
    "converts Celsius to Fahrenheit",
    "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome",
    "flattens a nested list",
    "counts how often each word appears in a text",
    "computes the factorial of a number",
    "finds the second smallest element of a list",
    "splits a list into chunks of a given size",
    "returns the common elements of two lists",
    "capitalizes the first letter of every word",
    "computes the average of a list of numbers",
    "rotates a list by k positions",
    "checks whether two words are anagrams",
    "parses a date written as YYYY-MM-DD",
    "sums the digits of an integer",
    "converts a binary string to an integer",
    "returns the longest word in a sentence",
    "validates a simple email address",
    "implements binary search on a sorted list",
    "transposes a matrix given as a list of lists",
    "reads a CSV file and prints the number of rows",
    "groups a list of words by their first letter",
    "computes the greatest common divisor of two numbers",
    "generates all subsets of a small set",
    "counts the lines of a text file",
    "finds the index of the first repeated character",
    "converts a list of pairs into a dictionary",
    "sorts a list of people by age",
    "returns the running total of a list",
    "checks whether brackets in a string are balanced",
    "computes the median of a list",
    "returns the n largest items of a list",
    "replaces every vowel in a string with a star",
    "computes the dot product of two vectors",
    "builds a frequency table of characters",
    "checks whether a year is a leap year",
    "converts a number to Roman numerals",
    "finds the missing number in a list from 1 to n",
    "returns the intersection of two sets of words",
    "computes compound interest",
    "removes all whitespace from a string",
    "returns every k-th element of a list",
    "checks whether a list is sorted",
    "computes the length of the longest increasing run in a list",
]
ARGS = ["items", "text", "n", "values", "words", "numbers", "s", "data"]
CODE_FORMS = [
    "Write a {lang} function that {task}.",
    "Show me how to write a {lang} function that {task}, with a short explanation.",
    "I need a {lang} snippet that {task}. Keep it simple.",
    "Write a {lang} function that {task}, and add a usage example.",
    "How would you write code in {lang} that {task}?",
]
TOPICS = [
    "learning a new language",
    "saving money",
    "sleeping better",
    "starting to run",
    "keeping a plant alive",
    "cooking for one",
    "working from home",
    "preparing for an interview",
    "writing clearly",
    "travelling on a budget",
    "reading more books",
    "organizing a small kitchen",
    "staying focused",
    "learning to draw",
    "making new friends in a new city",
]
CONCEPTS = [
    "photosynthesis",
    "gravity",
    "inflation",
    "the water cycle",
    "how vaccines work",
    "why the sky is blue",
    "what a black hole is",
    "how a bicycle stays upright",
    "what DNA does",
    "how the internet sends data",
    "why we have seasons",
    "how a refrigerator keeps food cold",
    "what an atom is made of",
    "how bees make honey",
    "what a computer's memory does",
]
AUDIENCES = ["a child", "a beginner", "a high school student", "a busy adult", "my grandmother"]
FORMS = ["poem", "story", "thank-you note", "product description", "diary entry", "haiku"]
SUBJECTS = [
    "the ocean",
    "a rainy morning",
    "an old bicycle",
    "a lost cat",
    "the first day of spring",
    "a lighthouse",
    "a quiet library",
    "a cup of tea",
    "the moon",
    "a mountain village",
]
CHAT_FORMS = [
    "Give me {n} tips for {topic}.",
    "Explain {concept} to {audience}.",
    "Write a short {form} about {subject}.",
    "What are the pros and cons of {topic}?",
    "Can you summarize {concept} in a few sentences?",
    "Describe {subject} in three sentences.",
]
ITEMS = ["apple", "notebook", "pencil", "ticket", "sandwich", "book", "plant", "shirt"]
NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jun"]


def reasoning(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 9)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    forms = [
        f"A {item} costs {a} dollars. {name} buys {b} of them and pays with a {a * b + c * 10}-"
        "dollar bill. How much change does "
        f"{name} get? Explain step by step.",
        f"A train travels {a * 10} km in {b} hours. What is its average speed? Show your work.",
        f"{name} has {a} marbles and gives away {c}. Then {name} doubles what is left. How many "
        "marbles are there now?",
        f"What is {a} times {b}, plus {c}? Think it through step by step.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"If {b} workers build a wall in {a} days, how long would {b * 2} workers take, working "
        "at the same pace?",
        f"{name} reads {c + 5} pages a day. How many days does a {a * 20}-page book take?",
        f"Is {a * b + 1} a prime number? Explain how you checked.",
    ]
    return rng.choice(forms)


def stub(rng: random.Random) -> str:
    """A Python function to complete: a signature and a docstring, written here."""
    task = rng.choice(TASKS)
    name = "_".join(w.strip(",") for w in task.split()[:4] if w.isalpha() and w != "a")
    args = ", ".join(rng.sample(ARGS, rng.randint(1, 2)))
    doc = f"Return the result of a function that {task}."
    form = rng.choice(
        [
            'Complete this Python function:\n\ndef {name}({args}):\n    """{doc}"""\n',
            'def {name}({args}):\n    """{doc}\n\n    Write the body.\n    """\n',
            "Finish the implementation below.\n\n```python\ndef {name}({args}):\n    # {doc}\n```",
        ]
    )
    return form.format(name=name, args=args, doc=doc)


def prompt(rng: random.Random) -> tuple[str, str]:
    """(kind, prompt text): one of code, chat or reasoning, in roughly equal parts."""
    kind = rng.choice(["code", "chat", "reasoning"])
    if kind == "code":
        if rng.random() < 0.4:
            return kind, stub(rng)
        return kind, rng.choice(CODE_FORMS).format(
            lang=rng.choice(LANGUAGES), task=rng.choice(TASKS)
        )
    if kind == "chat":
        return kind, rng.choice(CHAT_FORMS).format(
            n=rng.randint(3, 7),
            topic=rng.choice(TOPICS),
            concept=rng.choice(CONCEPTS),
            audience=rng.choice(AUDIENCES),
            form=rng.choice(FORMS),
            subject=rng.choice(SUBJECTS),
        )
    return kind, reasoning(rng)


def prompt_mix(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct prompts as `{"turns": [text], "kind": ...}` rows."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    tries = 0
    while len(rows) < count and tries < count * 50:
        tries += 1
        kind, text = prompt(rng)
        if text not in seen:
            seen.add(text)
            rows.append({"turns": [text], "kind": kind})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = prompt_mix(args.count, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("code", "chat", "reasoning")}
    print(f"{len(rows)} prompts -> {args.out} ({kinds})")


if __name__ == "__main__":
    main()
