"""Code prompts drawn from this Python's own standard library: functions to write from their
signatures and documentation, classes to write from theirs, and real functions of its source
to explain, test, rewrite or translate.

The templates of prompts.py give a few hundred distinct tasks, which a drafter learns by heart
(held-out acceptance on the mix far above acceptance on code it has not seen). The standard
library's own sources give thousands of distinct, real functions and methods, `self.` and all,
which is what a coding prompt shows a model: code to read and code to change. Nothing here reads
an evaluation set.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import re
import sysconfig
import textwrap
import warnings
from functools import cache
from pathlib import Path
from typing import Any

# Modules written in Python whose public functions make good "write this function" prompts.
STDLIB = [
    "base64",
    "bisect",
    "calendar",
    "colorsys",
    "copy",
    "csv",
    "datetime",
    "difflib",
    "email.utils",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.cookies",
    "imghdr",
    "ipaddress",
    "json",
    "keyword",
    "linecache",
    "locale",
    "mimetypes",
    "netrc",
    "ntpath",
    "operator",
    "os",
    "pathlib",
    "pkgutil",
    "platform",
    "posixpath",
    "pprint",
    "quopri",
    "random",
    "re",
    "reprlib",
    "shlex",
    "shutil",
    "smtplib",
    "statistics",
    "string",
    "tarfile",
    "tempfile",
    "textwrap",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "urllib.parse",
    "uu",
    "uuid",
    "warnings",
    "wave",
    "webbrowser",
    "zipfile",
]
STUB_FORMS = [
    'Complete this Python function:\n\n```python\ndef {name}{sig}:\n    """{doc}"""\n```',
    'def {name}{sig}:\n    """{doc}\n    """\n',
    "Write a Python function `{name}{sig}`. {doc}",
    "Implement `{name}{sig}` yourself, without importing `{module}`. What it should do: {doc}",
    "Write {name}{sig} in Python and test it with two examples.\n\n{doc}",
]
LIBRARY_CHAT = [
    "What does `{module}.{name}` do in Python? Show a short example.",
    "When would I use Python's `{module}` module? Give two examples.",
    "Explain this Python documentation to a beginner: {doc}",
    "Write a small Python script that uses `{module}.{name}` and explain each line.",
]


@cache
def stdlib_modules() -> tuple[tuple[str, Any], ...]:
    """(name, module) of the STDLIB modules this Python has."""
    found = []
    for module_name in STDLIB:
        try:
            with warnings.catch_warnings():  # imghdr, uu, ...: deprecated, still documented
                warnings.simplefilter("ignore", DeprecationWarning)
                found.append((module_name, importlib.import_module(module_name)))
        except Exception:  # removed in this Python, or no platform support
            continue
    return tuple(found)


@cache
def library_functions() -> tuple[tuple[str, str, str, str], ...]:
    """(module, name, signature, first docstring paragraph) of documented stdlib functions."""
    found = []
    for module_name, module in stdlib_modules():
        for name, fn in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            if getattr(fn, "__module__", None) != module.__name__:
                continue
            doc = (inspect.getdoc(fn) or "").split("\n\n")[0].strip()
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if 20 <= len(doc) <= 400 and len(sig) <= 80:
                # a default that is a function or a bound built-in prints with its address
                # (another each run): keep its name only
                sig = re.sub(
                    r"<(?:function|built-in method) (\S+)[^<>]* at 0x[0-9a-f]+>", r"\1", sig
                )
                found.append((module_name, name, sig, " ".join(doc.split())))
    return tuple(found)


def library(rng: random.Random) -> tuple[str, str]:
    """A code or chat prompt about one standard-library function."""
    module, name, sig, doc = rng.choice(library_functions())
    if rng.random() < 0.75:
        return "code", rng.choice(STUB_FORMS).format(module=module, name=name, sig=sig, doc=doc)
    return "chat", rng.choice(LIBRARY_CHAT).format(module=module, name=name, doc=doc)


# Source files left out: tests, tools, platform GUIs and the deprecated or generated ones.
SKIP_SOURCES = re.compile(r"^(test|idlelib|tkinter|turtledemo|lib2to3|ensurepip|pydoc_data|_)")
SOURCE_FORMS = [
    "Explain what this Python function does:\n\n```python\n{src}\n```",
    "Add type hints and a docstring to this function:\n\n```python\n{src}\n```",
    "Rewrite this function so that it is easier to read:\n\n```python\n{src}\n```",
    "Write two pytest tests for this function:\n\n```python\n{src}\n```",
    "Translate this Python code to {lang}:\n\n```python\n{src}\n```",
    "Is there anything wrong with this code? Explain, then show a fixed version.\n\n"
    "```python\n{src}\n```",
    "{src}\n\nWhat does this code do, line by line?",
    "Here is a function from a project I am reading:\n\n```python\n{src}\n```\n\n"
    "Can you add comments to it?",
]
CLASS_FORMS = [
    "Write a Python class `{name}`. {doc}",
    "Implement a small version of `{module}.{name}` as a Python class: {doc}",
    "Design a Python class `{name}` with a constructor and two or three methods. It should do "
    "this: {doc}",
    'Complete this class:\n\n```python\nclass {name}:\n    """{doc}"""\n\n    def __init__(self'
    "):\n```",
]
SOURCE_LANGUAGES = ["JavaScript", "Go", "Rust", "Java", "C++", "TypeScript"]


@cache
def source_functions() -> tuple[str, ...]:
    """Functions and methods of the standard library's top-level .py files, dedented: 3 to 20
    lines and at most 640 characters each (a prompt and its answer fit one training window)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.glob("*.py")):
        if SKIP_SOURCES.match(path.name):
            continue
        try:
            text = path.read_text("utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.decorator_list:
                continue
            if node.name.startswith("__") or node.end_lineno is None:
                continue
            body = lines[node.lineno - 1 : node.end_lineno]
            src = textwrap.dedent("\n".join(body)).strip("\n")
            if 3 <= len(body) <= 20 and len(src) <= 640 and src.startswith("def "):
                found.append(src)
    return tuple(found)


@cache
def library_classes() -> tuple[tuple[str, str, str], ...]:
    """(module, name, first docstring paragraph) of documented classes of STDLIB."""
    found = []
    for module_name, module in stdlib_modules():
        for name, cls in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isclass(cls):
                continue
            if getattr(cls, "__module__", None) != module.__name__ or issubclass(cls, Exception):
                continue
            doc = (inspect.getdoc(cls) or "").split("\n\n")[0].strip()
            if 20 <= len(doc) <= 400:
                found.append((module_name, name, " ".join(doc.split())))
    return tuple(found)


def source(rng: random.Random) -> str:
    """A real function of the standard library to explain, test, rewrite or translate."""
    return rng.choice(SOURCE_FORMS).format(
        src=rng.choice(source_functions()), lang=rng.choice(SOURCE_LANGUAGES)
    )


def library_class(rng: random.Random) -> str:
    """A class to write from a standard-library class's documentation."""
    module, name, doc = rng.choice(library_classes())
    return rng.choice(CLASS_FORMS).format(module=module, name=name, doc=doc)
