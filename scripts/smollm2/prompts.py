"""A synthetic prompt mix for self-distilling SmolLM2's drafters: code, chat and reasoning.

Every prompt is built here from templates and word lists, or from this Python's own standard
library (stdlib_prompts.py: functions and classes to write from their documentation, real
functions of its source to explain, test, rewrite or translate), seeded, so the mix is
reproducible on one Python version and shares nothing with public evaluation sets (MT-Bench,
HumanEval, MBPP, GSM8K, MATH-500 and the rest are never read). The target answers each prompt
itself during training; these are only the questions.

    python scripts/smollm2/prompts.py --count 4096 --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings: stdlib_prompts, words
from stdlib_prompts import (  # noqa: E402
    library,
    library_class,
    library_classes,
    library_functions,
    source,
    source_functions,
)
from words import (  # noqa: E402
    ARGS,
    AUDIENCES,
    CHAT_FORMS,
    CODE_FORMS,
    CONCEPTS,
    FORMS,
    ITEMS,
    LANGUAGES,
    NAMES,
    SELVES,
    SUBJECTS,
    TASKS,
    TOPICS,
)


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
        f"{name} earns {a * 5} dollars a week and saves {c * 10}% of it. How much is saved after "
        f"{b} weeks?",
        f"A shop sells a {item} for {a * 3} dollars and takes {c * 5}% off. What is the new price?",
        f"{name} is {a} years old. {rng.choice(NAMES)} is {c} years younger. How old will they "
        f"be together in {b} years?",
        f"What is {c}/{b} + {a}/{b * 2} as a fraction in lowest terms?",
        f"A recipe needs {c} eggs for {b} people. How many eggs for {b * a} people?",
        f"The numbers {a}, {a + c}, {a + 2 * c}, ... form a sequence. What is its {b}th term?",
        f"Solve for x: {b}x + {c} = {b * a + c}.",
        f"A tank holds {a * 10} liters and drains {b} liters a minute. How long until it is empty?",
        f"Find the average of {a}, {b}, {c} and {a + b + c}.",
        f"A car uses {c + 4} liters of fuel per 100 km. How much fuel does a {a * 15} km trip "
        "take?",
        f"How many minutes are there in {b} hours and {a} minutes? And how many seconds?",
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


def _ints(rng: random.Random, n: int = 0) -> list[int]:
    return [rng.randint(-9, 30) for _ in range(n or rng.randint(3, 7))]


def _word(rng: random.Random) -> str:
    return rng.choice(SUBJECTS + TOPICS).split()[-1].strip(",.")


def _sentence(rng: random.Random) -> str:
    return rng.choice(SUBJECTS + TOPICS + CONCEPTS)


def _runs(xs: list[int]) -> int:
    best = run = 1 if xs else 0
    for a, b in zip(xs, xs[1:]):
        run = run + 1 if b > a else 1
        best = max(best, run)
    return best


# Small functions written here, with a typed signature, a one-line description, the argument
# sampler and a reference implementation: the implementation computes the examples a prompt
# shows (doctest lines or asserts), so every example is true.
TYPED = [
    (
        "sum_of_evens",
        "(numbers: List[int]) -> int",
        "Return the sum of the even numbers in the list.",
        lambda r: (_ints(r),),
        lambda xs: sum(x for x in xs if x % 2 == 0),
    ),
    (
        "count_negatives",
        "(numbers: List[int]) -> int",
        "Count how many numbers in the list are negative.",
        lambda r: (_ints(r),),
        lambda xs: sum(x < 0 for x in xs),
    ),
    (
        "running_max",
        "(numbers: List[int]) -> List[int]",
        "Return a list where each element is the largest number seen so far.",
        lambda r: (_ints(r),),
        lambda xs: [max(xs[: i + 1]) for i in range(len(xs))],
    ),
    (
        "pairwise_differences",
        "(numbers: List[int]) -> List[int]",
        "Return the differences between each pair of neighbouring numbers.",
        lambda r: (_ints(r),),
        lambda xs: [b - a for a, b in zip(xs, xs[1:])],
    ),
    (
        "longest_increasing_run",
        "(numbers: List[int]) -> int",
        "Return the length of the longest strictly increasing run of neighbouring numbers.",
        lambda r: (_ints(r),),
        _runs,
    ),
    (
        "second_largest",
        "(numbers: List[int]) -> int",
        "Return the second largest distinct number in the list.",
        lambda r: (sorted(set(_ints(r, 6)))[:5] + [99],),
        lambda xs: sorted(set(xs))[-2],
    ),
    (
        "rotate_left",
        "(items: List[int], k: int) -> List[int]",
        "Rotate the list to the left by k positions.",
        lambda r: (_ints(r), r.randint(0, 4)),
        lambda xs, k: xs[k % len(xs) :] + xs[: k % len(xs)],
    ),
    (
        "chunk_list",
        "(items: List[int], size: int) -> List[List[int]]",
        "Split the list into consecutive chunks of the given size; the last chunk may be shorter.",
        lambda r: (_ints(r), r.randint(2, 3)),
        lambda xs, n: [xs[i : i + n] for i in range(0, len(xs), n)],
    ),
    (
        "count_vowels",
        "(text: str) -> int",
        "Count the vowels (a, e, i, o, u) in a string.",
        lambda r: (_sentence(r),),
        lambda t: sum(c in "aeiou" for c in t.lower()),
    ),
    (
        "reverse_words",
        "(sentence: str) -> str",
        "Return the sentence with its words in reverse order.",
        lambda r: (_sentence(r),),
        lambda t: " ".join(reversed(t.split())),
    ),
    (
        "capitalize_words",
        "(sentence: str) -> str",
        "Capitalize the first letter of every word.",
        lambda r: (_sentence(r),),
        lambda t: " ".join(w[:1].upper() + w[1:] for w in t.split()),
    ),
    (
        "is_palindrome",
        "(text: str) -> bool",
        "Check whether a string reads the same forwards and backwards, ignoring case.",
        lambda r: (r.choice(["Level", "radar", "python", "Noon", "banana", "racecar", "abca"]),),
        lambda t: t.lower() == t.lower()[::-1],
    ),
    (
        "char_frequency",
        "(text: str) -> Dict[str, int]",
        "Return a dictionary mapping each character of the word to how often it appears.",
        lambda r: (_word(r),),
        lambda t: {c: t.count(c) for c in dict.fromkeys(t)},
    ),
    (
        "remove_duplicates",
        "(items: List[int]) -> List[int]",
        "Remove duplicate numbers from the list, keeping the first occurrence of each.",
        lambda r: ([r.randint(0, 5) for _ in range(7)],),
        lambda xs: list(dict.fromkeys(xs)),
    ),
    (
        "digit_sum",
        "(n: int) -> int",
        "Return the sum of the decimal digits of a non-negative integer.",
        lambda r: (r.randint(0, 99999),),
        lambda n: sum(map(int, str(n))),
    ),
    (
        "is_prime",
        "(n: int) -> bool",
        "Check whether n is a prime number.",
        lambda r: (r.randint(0, 60),),
        lambda n: n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)),
    ),
    (
        "fizzbuzz_word",
        "(n: int) -> str",
        "Return 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else the number as a string.",
        lambda r: (r.randint(1, 40),),
        lambda n: (
            "FizzBuzz"
            if n % 15 == 0
            else "Fizz"
            if n % 3 == 0
            else "Buzz"
            if n % 5 == 0
            else str(n)
        ),
    ),
    (
        "to_binary",
        "(n: int) -> str",
        "Return the binary representation of a non-negative integer, without a prefix.",
        lambda r: (r.randint(0, 300),),
        lambda n: format(n, "b"),
    ),
    (
        "count_words",
        "(sentence: str) -> int",
        "Count the words in a sentence.",
        lambda r: (_sentence(r),),
        lambda t: len(t.split()),
    ),
    (
        "merge_sorted",
        "(a: List[int], b: List[int]) -> List[int]",
        "Merge two sorted lists into one sorted list.",
        lambda r: (sorted(_ints(r, 3)), sorted(_ints(r, 4))),
        lambda a, b: sorted(a + b),
    ),
    (
        "common_elements",
        "(a: List[int], b: List[int]) -> List[int]",
        "Return the sorted list of numbers that appear in both lists.",
        lambda r: ([r.randint(0, 9) for _ in range(5)], [r.randint(0, 9) for _ in range(5)]),
        lambda a, b: sorted(set(a) & set(b)),
    ),
    (
        "clamp_all",
        "(numbers: List[int], low: int, high: int) -> List[int]",
        "Clamp every number of the list into the range from low to high.",
        lambda r: (_ints(r), 0, r.randint(5, 20)),
        lambda xs, lo, hi: [min(max(x, lo), hi) for x in xs],
    ),
    (
        "longest_word",
        "(sentence: str) -> str",
        "Return the longest word of the sentence; the first one if several are equally long.",
        lambda r: (_sentence(r),),
        lambda t: max(t.split(), key=len),
    ),
    (
        "gcd",
        "(a: int, b: int) -> int",
        "Return the greatest common divisor of two positive integers.",
        lambda r: (r.randint(1, 60), r.randint(1, 60)),
        lambda a, b: __import__("math").gcd(a, b),
    ),
    (
        "count_upper",
        "(text: str) -> int",
        "Count the uppercase letters in a string.",
        lambda r: (_sentence(r).title(),),
        lambda t: sum(c.isupper() for c in t),
    ),
    (
        "squares_up_to",
        "(n: int) -> List[int]",
        "Return the squares of the numbers from 1 to n.",
        lambda r: (r.randint(1, 7),),
        lambda n: [i * i for i in range(1, n + 1)],
    ),
    (
        "mean",
        "(numbers: List[float]) -> float",
        "Return the arithmetic mean of a non-empty list.",
        lambda r: ([float(x) for x in _ints(r, 4)],),
        lambda xs: sum(xs) / len(xs),
    ),
    (
        "is_sorted",
        "(numbers: List[int]) -> bool",
        "Check whether the list is sorted in ascending order.",
        lambda r: (r.choice([sorted(_ints(r)), _ints(r)]),),
        lambda xs: xs == sorted(xs),
    ),
    (
        "first_repeated",
        "(text: str) -> str",
        "Return the first character that appears twice in the string, or an empty string if none does.",
        lambda r: (_word(r),),
        lambda t: next((c for i, c in enumerate(t) if c in t[:i]), ""),
    ),
    (
        "flatten",
        "(nested: List[List[int]]) -> List[int]",
        "Flatten a list of lists into one list.",
        lambda r: ([_ints(r, 2) for _ in range(r.randint(2, 3))],),
        lambda xss: [x for xs in xss for x in xs],
    ),
]
TYPED_FORMS = [
    "Implement this Python function so that the examples in its docstring hold:\n"
    '```python\n{header}def {name}{sig}:\n    """ {doc}\n{doctests}    """\n\n```',
    'Complete the following Python code:\n```python\n{header}def {name}{sig}:\n    """{doc}\n'
    '{doctests}    """\n```',
    "Write a function to {verb}. Your code should pass these tests:\n\n{asserts}",
    "Write a python function `{name}` that does this: {doc}\n\n{asserts}",
]


def typed(rng: random.Random) -> str:
    """A typed Python function to write, with examples its reference implementation computed."""
    name, sig, doc, sample, fn = rng.choice(TYPED)
    calls = []
    for _ in range(rng.randint(2, 3)):
        args = sample(rng)
        calls.append((f"{name}({', '.join(repr(a) for a in args)})", repr(fn(*args))))
    uses = [t for t in ("List", "Dict") if t + "[" in sig]
    header = f"from typing import {', '.join(uses)}\n\n\n" if uses else ""
    doctests = "".join(f"    >>> {call}\n    {result}\n" for call, result in calls)
    asserts = "\n".join(f"assert {call} == {result}" for call, result in calls)
    verb = doc[0].lower() + doc[1:].rstrip(".")
    return rng.choice(TYPED_FORMS).format(
        header=header, name=name, sig=sig, doc=doc, doctests=doctests, asserts=asserts, verb=verb
    )


def infinitive(task: str) -> str:
    """'reverses a string' -> 'reverse a string'."""
    verb, _, rest = task.partition(" ")
    if verb.endswith("es") and verb[:-2].endswith(("ch", "sh", "x", "ss")):
        verb = verb[:-2]
    elif verb.endswith("s"):
        verb = verb[:-1]
    return f"{verb} {rest}"


PLAIN_FORMS = [
    "Write a python function to {task}.",
    "Write a function to {task}.",
    "Write a Python program to {task}.",
    "Write a function that takes a list or a string as input and {does}.",
]


def prompt(rng: random.Random) -> tuple[str, str]:
    """(kind, prompt text): code, chat or reasoning, weighted toward code; half the code
    prompts come from the standard library's own functions, methods and classes."""
    kind = rng.choices(["code", "chat", "reasoning"], weights=[50, 28, 22])[0]
    draw = rng.random()
    if kind == "code" and draw < 0.35 and source_functions():
        return kind, source(rng)
    if kind == "code" and draw < 0.45 and library_classes():
        return kind, library_class(rng)
    if kind == "code" and draw < 0.6:
        return kind, typed(rng)
    if kind == "code" and draw < 0.68:
        task = rng.choice(TASKS)
        return kind, rng.choice(PLAIN_FORMS).format(task=infinitive(task), does=task)
    if kind == "code" and draw < 0.88 and library_functions():
        return library(rng)
    if kind == "code":
        if rng.random() < 0.4:
            return kind, stub(rng)
        return kind, rng.choice(CODE_FORMS).format(
            lang=rng.choice(LANGUAGES), task=rng.choice(TASKS)
        )
    if kind == "chat":
        topic = rng.choice(TOPICS)
        return kind, rng.choice(CHAT_FORMS).format(
            n=rng.randint(3, 7),
            topic=topic,
            topic_ing=topic,
            audience_self=rng.choice(SELVES),
            concept=rng.choice(CONCEPTS),
            concept2=rng.choice(CONCEPTS),
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
