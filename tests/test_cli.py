"""The `outrider` command line, end to end on tiny random-weight models (no network)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from cli_runner import invoke, module_env, run_module
from rich.console import Console
from typer.testing import CliRunner

from outrider import cli, cli_common, telemetry
from outrider.api import load
from outrider.cli_common import parse_max_draft
from outrider.testing import make_tiny_drafter, make_tiny_target

PROMPT = "The quick brown fox jumps over the lazy dog."
RESULT_KEYS = {
    "text",
    "prompt_tokens",
    "tokens",
    "rounds",
    "mean_accept_len",
    "prefill_tps",
    "decode_tps",
    "peak_memory_gb",
    "mode",
    "max_draft",
}


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-models")
    target = make_tiny_target(root / "qwen3-tiny-target")
    dspark = make_tiny_drafter(root / "dspark", target, kind="dspark", packaging="deepspec")
    zlab = make_tiny_drafter(root / "dflash", target, kind="dflash", packaging="zlab")
    return {"target": str(target), "dspark": str(dspark), "dflash": str(zlab)}


def generate_args(models: dict[str, str], mode: str, *extra: str) -> list[str]:
    args = ["generate", "--model", models["target"], "--mode", mode, "--prompt", PROMPT]
    if mode in ("dspark", "dflash"):
        args += ["--drafter", models[mode]]
    return args + ["--max-tokens", "24", *extra]


# --- generate --json -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def json_runs(models) -> dict[str, dict]:
    runs = {}
    for mode in ("baseline", "dspark", "dflash", "lookup"):
        result = invoke(*generate_args(models, mode, "--json"))
        assert result.exit_code == 0, result.output
        runs[mode] = json.loads(result.stdout)  # stdout is exactly one JSON object
    return runs


@pytest.mark.parametrize("mode", ["dspark", "dflash", "lookup", "baseline"])
def test_generate_json_shape(json_runs, mode):
    out = json_runs[mode]
    assert RESULT_KEYS <= set(out)
    assert out["mode"] == mode
    assert len(out["tokens"]) == 24 or out["finish_reason"] == "stop"
    assert all(set(r) == {"drafted", "accepted"} for r in out["rounds"])
    assert all(0 <= r["accepted"] <= len(r["drafted"]) for r in out["rounds"])
    if mode == "baseline":
        assert out["max_draft"] == 0
    else:
        assert out["max_draft"] > 0 and out["rounds"]


def test_generate_is_lossless_across_modes(json_runs):
    reference = json_runs["baseline"]
    for mode, out in json_runs.items():
        assert out["prompt_tokens"] == reference["prompt_tokens"], mode
        assert out["tokens"] == reference["tokens"], mode
        assert out["text"] == reference["text"], mode


def test_auto_mode_takes_the_drafters_kind(models, json_runs):
    result = invoke(
        "generate",
        "--model",
        models["target"],
        "--drafter",
        models["dspark"],
        "--prompt",
        PROMPT,
        "--max-tokens",
        "24",
        "--json",
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["mode"] == "dspark"
    assert out["tokens"] == json_runs["baseline"]["tokens"]


def test_generate_options_pass_through(models):
    result = invoke(
        *generate_args(
            models,
            "lookup",
            "--json",
            "--raw",
            "--max-draft",
            "2",
            "--stop",
            "zz",
            "--stop",
            "yy",
            "--temperature",
            "0.7",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
            "--seed",
            "3",
        )
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["max_draft"] == 2
    assert all(len(r["drafted"]) <= 2 for r in out["rounds"])
    with_system = invoke(*generate_args(models, "lookup", "--json", "--system", "be brief"))
    assert len(json.loads(with_system.stdout)["prompt_tokens"]) > len(out["prompt_tokens"])


def test_prompt_from_standard_input(models, json_runs):
    args = [a for a in generate_args(models, "baseline", "--json") if a not in ("--prompt", PROMPT)]
    result = invoke(*args, input=PROMPT)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == json_runs["baseline"]["tokens"]


# --- bad input -------------------------------------------------------------------------------


def assert_one_error_line(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "hi", "--max-tokens", "-1"], "--max-tokens"),
        (["--prompt", "hi", "--mode", "nonsense"], "unknown mode 'nonsense'"),
        (["--prompt", "hi", "--drafter-bits", "3"], "--drafter-bits"),
        (["--prompt", "hi", "--max-draft", "lots"], "--max-draft takes a number"),
        (["--prompt", "hi", "--lookup-long-draft", "0"], "--lookup-long-draft must be in"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--mode", "dspark"], "needs a drafter"),
    ],
)
def test_bad_input_is_one_error_line(models, extra, expect):
    result = invoke("generate", "--model", models["target"], *extra)
    assert expect in assert_one_error_line(result)


def test_missing_model_is_one_error_line(tmp_path):
    line = assert_one_error_line(
        invoke("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    )
    assert "nope" in line


def test_empty_standard_input(models):
    result = invoke("generate", "--model", models["target"], input="  \n")
    assert "the prompt is empty" in assert_one_error_line(result)


def test_drafter_of_the_wrong_kind(models):
    result = invoke(*generate_args(models, "dflash"), "--mode", "dspark")
    assert_one_error_line(result)


def test_drafter_passed_as_model_is_one_short_line(models):
    line = assert_one_error_line(invoke("generate", "--model", models["dspark"], "--prompt", "hi"))
    assert len(line) < cli_common.MAX_ERROR + 80


def test_usage_error_is_short(models):
    result = invoke("generate", "--model", models["target"], "--max-tokens", "many")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_entry_point_error_is_one_line(tmp_path):
    proc = run_module("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    stderr = proc.stderr.decode()
    assert proc.returncode == 2
    assert stderr.splitlines() == [stderr.strip()] and stderr.startswith("error: ")
    assert proc.stdout == b""


def test_debug_shows_the_traceback(tmp_path):
    proc = run_module(
        "generate",
        "--model",
        str(tmp_path / "missing"),
        "--prompt",
        "hi",
        env={"OUTRIDER_DEBUG": "1"},
    )
    assert proc.returncode != 0
    assert b"Traceback" in proc.stderr and b"ModelNotFoundError" in proc.stderr


def test_main_turns_errors_into_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_mlx_dspark_spellings_run_as_they_did(models, json_runs, capsys):
    """mlx-dspark's command lines run unchanged: generate is the default command
    (`outrider --prompt TEXT`), --target is --model, a --max-draft below 0 is the full block
    (with the note), and --no-stream prints the whole text, then the summary on stderr."""
    assert cli.default_command(["--prompt", "x"]) == ["generate", "--prompt", "x"]
    assert cli.default_command(["-p=x"]) == ["generate", "-p=x"]
    for args in ([], ["--help"], ["--version"], ["serve", "--port", "1"], ["doctor"]):
        assert cli.default_command(args) == args
    args = generate_args(models, "baseline", "--json")[1:]  # no command: generate's options
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--target" if a == "--model" else a for a in args])
    assert exit_info.value.code == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == json_runs["baseline"]["tokens"]
    both = invoke(*generate_args(models, "baseline"), "--target", "elsewhere")
    assert "--target is another name for --model" in assert_one_error_line(both)
    below = invoke(*generate_args(models, "dflash", "--json", "--max-draft", "-1"))
    full = load(models["target"], models["dflash"], "dflash").proposer.max_draft
    assert json.loads(below.stdout)["max_draft"] == full
    assert "full block" in below.stderr
    at_once = invoke(*generate_args(models, "baseline", "--no-stream"))
    assert at_once.exit_code == 0, at_once.output
    text = load(models["target"], mode="baseline").generate(PROMPT, max_tokens=24).text
    assert at_once.stdout == text + ("" if text.endswith("\n") else "\n")
    assert "tokens" in at_once.stderr and "decode" in at_once.stderr


# --- plain and live output -------------------------------------------------------------------


def test_plain_output_when_stdout_is_not_a_terminal(models, json_runs):
    proc = run_module(*generate_args(models, "dspark"))
    assert proc.returncode == 0, proc.stderr
    text = json_runs["dspark"]["text"]
    assert proc.stdout.decode() == (text if text.endswith("\n") else text + "\n")
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines  # no transformers advisory, just the summary
    assert lines[0].startswith("24 tokens · ") and "decode" in lines[0]
    assert "accept" in lines[0] and "mode dspark · cap" in lines[0]


def test_a_terminal_sees_a_spinner_while_the_model_loads(models):
    """Loading can take minutes (a first `auto` run measures the machine; a cold CUDA machine
    compiles kernels): a terminal shows what is loading; the test above shows a pipe does not."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "outrider", *generate_args(models, "lookup")],
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env=module_env({"TERM": "xterm"}),
    )
    os.close(follower)  # the child holds the terminal now: reads end when it exits
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)  # read as it comes: a full terminal would block it
        except OSError:  # EIO: the child's end is closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    proc.wait()
    assert proc.returncode == 0
    assert f"loading {models['target']}".encode() in seen


def test_plain_streaming_matches_the_result(models, json_runs):
    result = invoke(*generate_args(models, "lookup"))
    assert result.exit_code == 0, result.output
    text = json_runs["lookup"]["text"]
    assert result.stdout == (text if text.endswith("\n") else text + "\n")
    assert "mode lookup" in result.stderr


def test_live_telemetry_renders(models, json_runs):
    pipe = load(models["target"], models["dspark"], "dspark")
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=80, color_system="truecolor")
    kwargs = {"max_tokens": 24}
    result = telemetry.stream_live(pipe, PROMPT, kwargs, console)
    assert result is not None and result.tokens == json_runs["dspark"]["tokens"]
    shown = buffer.getvalue()
    for word in ("decode", "prefill", "mean accept length", "rounds", "peak memory", "dspark"):
        assert word in shown


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.startswith("outrider ")


def test_a_prompt_over_the_context_window_is_refused_in_one_line(models):
    """The server's rule in `generate`: a 20k-token prompt on a 4k model used to prefill for
    minutes, with no word."""
    window = load(models["target"], mode="baseline").target.context_window
    assert window is not None
    long = "w" * (window + 10)  # one byte, one token at least
    result = invoke(
        "generate", "--model", models["target"], "--mode", "lookup", "--raw", "-p", long
    )
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the prompt is ")
    assert f"context window is {window}" in lines[0]


def test_the_live_view_shows_prefill_progress(models, monkeypatch):
    from outrider.core import target as target_mod

    monkeypatch.setattr(target_mod, "PREFILL_CHUNK", 8)
    pipe = load(models["target"], mode="lookup")
    seen = []
    view = telemetry.LiveView("lookup", 4)

    def heard(done: int, total: int) -> None:
        view.prefill(done, total)
        seen.append(view.status().plain)

    ids = pipe.encode(PROMPT * 3, raw=True)
    pipe.generate(ids, max_tokens=2, prefill_progress=heard)
    assert seen[0] == f"prefill 8/{len(ids)} prompt tokens ({800 // len(ids)}%) · Ctrl-C stops"
    assert len(seen) == (len(ids) - 2) // 8 + 1  # every chunk but the last token's forward


def test_version_and_help_load_no_model_library():
    """`outrider --version`, `outrider --help` and a command's `--help` answer without importing
    mlx-lm or transformers (seconds): help lists the commands plugins add without importing the
    built-in plugins, which bring them in (2.1 s -> 0.3 s on a 2-core CPU; `core/plugins.py`
    `CommandPlugins`)."""
    code = (
        "import sys\n"
        "from outrider.__main__ import run\n"
        "for argv in (['outrider', '--version'], ['outrider', '--help'],\n"
        "             ['outrider', 'serve', '--help']):\n"
        "    sys.argv = argv\n"
        "    try:\n"
        "        run()\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        "print(sorted(m for m in ('mlx_lm', 'transformers', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("outrider ") and lines[-1] == "[]"
    assert "generate" in done.stdout and "--max-batch" in done.stdout


def test_ctrl_c_while_starting_up_is_one_line():
    """An interrupt inside the imports of the first seconds: exit 130, no traceback."""
    code = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'outrider.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['outrider', 'generate', '-p', 'hi']\n"
        "from outrider.__main__ import run\n"
        "run()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 130
    assert done.stderr.strip() == "interrupted"


def test_unreadable_input_is_one_line(models, tmp_path):
    """Non-UTF-8 standard input, an unreadable config.json, an interrupted command."""
    result = CliRunner().invoke(
        cli.app, ["generate", "--model", models["target"]], input=b"def f(\xff\xfe):"
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: standard input is not UTF-8 text (byte 0xff at 6)"
    result = invoke("generate", "--model", models["target"], "-p", "def f(\udcff):")
    assert result.exit_code == 2 and "not valid UTF-8" in result.stderr
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "config.json").mkdir()  # unreadable as a file, whoever runs the test (root too)
    result = invoke("generate", "--model", str(locked), "-p", "hi")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "config.json" in result.stderr

    from outrider.core.errors import Interrupted

    with pytest.raises(typer.Exit) as e:
        with cli.user_errors():
            raise Interrupted("after step 4: checkpoint saved")
    assert e.value.exit_code == 130


def test_out_of_range_settings_are_refused_or_named(models):
    base = ["generate", "--model", models["target"], "-p", "hi", "-n", "2"]
    for bad in ("1.5", "-1"):
        result = invoke(*base, "--mode", "lookup", "--confidence-threshold", bad)
        assert result.exit_code == 2 and "--confidence-threshold must be in [0, 1]" in result.stderr
    result = invoke(
        *base, "--mode", "lookup", "--confidence-threshold", "0.5", "--max-draft", "1000"
    )
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: --max-draft 1000 is more than lookup can draft a round; running at cap 16",
        "warning: --confidence-threshold does nothing in lookup mode (DSpark only)",
    ]
    pipe = load(models["target"], mode="lookup")
    with pytest.raises(cli.OutriderError, match="the prompt is empty"):
        pipe.generate("  ")


# --- reference spellings (mlx-dspark, mlx_lm.generate) -----------------------------------------


def test_alias_spellings_match_outrider_spellings(models):
    base = ["generate", "--model", models["target"], "--mode", "lookup", "--json", "--seed", "1"]
    ours = invoke(*base, "-p", PROMPT, "-n", "12", "--temperature", "0.8", "--system", "be brief")
    theirs = invoke(
        *base,
        "-p",
        PROMPT,
        "--max-new-tokens",
        "12",
        "--temp",
        "0.8",
        "--system-prompt",
        "be brief",
    )
    assert ours.exit_code == 0 and theirs.exit_code == 0, theirs.output
    assert json.loads(theirs.stdout)["tokens"] == json.loads(ours.stdout)["tokens"]
    assert len(json.loads(theirs.stdout)["tokens"]) == 12
    raw = invoke(*base, "-p", PROMPT, "--raw")
    ignore = invoke(*base, "-p", PROMPT, "--ignore-chat-template")
    dspark = invoke(*base, "-p", PROMPT, "--no-chat-template")  # mlx-dspark's spelling
    assert json.loads(ignore.stdout)["prompt_tokens"] == json.loads(raw.stdout)["prompt_tokens"]
    assert json.loads(dspark.stdout)["prompt_tokens"] == json.loads(raw.stdout)["prompt_tokens"]
    assert json.loads(ignore.stdout)["prompt_tokens"] != json.loads(ours.stdout)["prompt_tokens"]


def test_prompt_dash_reads_standard_input(models, json_runs):
    args = [a for a in generate_args(models, "baseline", "--json") if a not in ("--prompt", PROMPT)]
    result = invoke(*args, "-p", "-", input=PROMPT)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == json_runs["baseline"]["tokens"]


def test_the_prompt_as_an_argument(models, json_runs):
    """`outrider generate "text"` is `--prompt "text"`; `-` reads standard input; both at once
    is one error line."""
    args = [a for a in generate_args(models, "baseline", "--json") if a not in ("--prompt", PROMPT)]
    for extra, stdin in (([PROMPT], None), (["-"], PROMPT)):
        result = invoke(*args, *extra, input=stdin)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["tokens"] == json_runs["baseline"]["tokens"]
    line = assert_one_error_line(invoke(*args, PROMPT, "--prompt", PROMPT))
    assert "as an argument or with --prompt, not both" in line


def test_max_draft_zero_is_the_full_block_with_a_note(models):
    result = invoke(*generate_args(models, "dflash", "--json", "--max-draft", "0"))
    assert result.exit_code == 0, result.output
    full = load(models["target"], models["dflash"], "dflash").proposer.max_draft
    assert json.loads(result.stdout)["max_draft"] == full > 0
    notes = [line for line in result.stderr.splitlines() if "--max-draft 0" in line]
    assert len(notes) == 1 and "full block" in notes[0]
    spelled = invoke(*generate_args(models, "dflash", "--json", "--max-draft", "full"))
    assert json.loads(spelled.stdout)["max_draft"] == full
    # serve reads the flag the same way (it hands "full" to the load: the engine's LoadSpec)
    assert parse_max_draft("0") == parse_max_draft("full") == "full"
    pipe = load(models["target"], models["dflash"], "dflash", max_draft="full")
    assert pipe.max_draft == full and pipe.cap_given and not pipe.auto_cap


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--min-p", "0.05"], "--min-p is not supported"),
        (["--max-kv-size", "8"], "--max-kv-size 8 would rotate"),
        (["--verbose", "maybe"], "--verbose takes true or false"),
    ],
)
def test_unsupported_mlx_lm_flags_are_one_error_line(models, extra, expect):
    result = invoke("generate", "--model", models["target"], "--prompt", "hi", *extra)
    assert expect in assert_one_error_line(result)


def test_harmless_mlx_lm_flags_are_accepted(models, json_runs):
    extra = ("--json", "--min-p", "0", "--max-kv-size", "100000")
    result = invoke(*generate_args(models, "baseline", *extra))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == json_runs["baseline"]["tokens"]


def test_verbose_false_prints_only_the_text(models):
    loud = invoke(*generate_args(models, "lookup", "--verbose", "true"))
    quiet = invoke(*generate_args(models, "lookup", "--verbose", "false"))
    assert loud.exit_code == 0 and quiet.exit_code == 0, quiet.output
    assert "tok/s" in loud.stderr and "tok/s" not in quiet.stderr
    assert quiet.stdout.strip() == loud.stdout.strip() != ""


def test_flags_are_not_shown_as_taking_values():
    for command in (["generate"], ["plugins"], ["models"]):
        shown = invoke(*command, "--help").stdout
        for line in shown.splitlines():
            if "--json" in line or "--raw" in line or "--no-thinking" in line:
                assert "<bool>" not in line, line
    assert invoke("generate", "--json", "true", "--prompt", "x").exit_code != 0  # a flag, no value


def test_command_modules_do_not_import_the_cli():
    """The commands share cli_common; none imports cli.py (which imports them: a circle)."""
    import ast

    root = Path(cli.__file__).parent
    modules = ("benchmark/command.py", "server/command.py", "train/command.py",
               "registry/listing.py", "doctor.py")  # fmt: skip
    for module in modules:
        tree = ast.parse((root / module).read_text())
        depth = module.count("/") + 1  # the relative level that reaches the package root
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                assert not (node.module == "cli" and node.level == depth), module
                assert not (node.module is None and "cli" in names), module
                assert node.module != "outrider.cli", module


@pytest.mark.parametrize(
    "flag, want", [((), None), (("--lookup-drafts",), True), (("--no-lookup-drafts",), False)]
)
def test_lookup_drafts_flag_forces_either_way(models, monkeypatch, flag, want):
    """`--lookup-drafts` (mlx-dspark's spelling) turns lookup copies on even where a registry
    row turns them off; `--no-lookup-drafts` off; neither leaves the row's default (None)."""
    import outrider.api
    from outrider.core.errors import OutriderError

    seen = {}

    def recording_load(*args, **kwargs):
        seen.update(kwargs)
        raise OutriderError("stop here")

    monkeypatch.setattr(outrider.api, "load", recording_load)  # generate imports it per call
    result = invoke(*generate_args(models, "dspark", *flag))
    assert "stop here" in result.output and seen["lookup_drafts"] is want
