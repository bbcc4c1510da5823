"""Every shell command the documentation shows runs as written from the repository root after the README's set-up.

The commands are those of fenced ``bash``/``sh``/``shell``/``console`` blocks (a ``console`` block's ``$ `` lines),
the lines of untagged fenced blocks that begin with a command, the command blocks of the examples' headers (a
script's docstring, a config's leading comment) and the quickstart's closing hints. Each simple command (after
line continuations, ``&&``, ``||``, ``;``, pipes and ``NAME=value`` prefixes) must name an executable that exists
after installation: ``.venv/bin/X`` under the repository root, or a system command (``python3`` only as
``python3 -m venv``). An ``hp-data`` command must name a subcommand of the CLI, ``python -m M`` an importable module,
``python script.py`` an existing file, and an argument inside a directory of the repository an existing path.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.data.tools.cli import COMMANDS
from hyper_parallel.data.tools.quickstart import closing_hints

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [REPO / "README.md", REPO / "benchmarks" / "README.md", REPO / "hyper_parallel" / "data" / "README.md"]
    + list((REPO / "docs").glob("*.md"))
)
EXAMPLE_HEADERS = sorted((REPO / "examples").glob("*.py")) + sorted((REPO / "examples").glob("*.yaml"))
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# What a fresh machine has besides the virtual environment; pip, pytest, torchrun and the like are .venv/bin/'s.
SYSTEM_COMMANDS = {"cd", "export", "unset", "mkdir", "ls", "cat", "echo", "rm", "cp", "mv", "git", "head", "tail",
                   "grep", "wc", "du", "tar", "gzip", "env", "time", "source", "true", "python3"}  # fmt: skip
PYTHONS = {"python", "python3", "python3.11"}
# The first word of a line that reads as a command in an untagged block or a header.
COMMAND_WORD = re.compile(r"(\.venv/|\$ |(python3?|pip3?|torchrun|hp-data|ruff|pytest)( |$))")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|", "&"}
FENCE = re.compile(r"^\s*```\s*(\S*)\s*$")


def _join_continuations(lines: list[str]) -> list[str]:
    joined: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
            continue
        joined.append(pending + line.strip())
        pending = ""
    if pending:
        joined.append(pending)
    return joined


def _looks_like_command(line: str) -> bool:
    return bool(COMMAND_WORD.match(line.strip()))


def commands_in_lines(lines: list[str], *, all_commands: bool, console: bool = False) -> list[str]:
    """The command lines of one block: every line, a console's ``$ `` lines, or the lines that begin with a
    command (a continued line belongs to the command it continues)."""
    found = []
    for line in _join_continuations(lines):
        text = line.strip()
        if console:
            if text.startswith("$ "):
                found.append(text[2:])
        elif all_commands and text and not text.startswith("#"):
            found.append(text)
        elif not all_commands and _looks_like_command(text):
            found.append(text.removeprefix("$ "))
    return found


def commands_in_markdown(text: str) -> list[str]:
    """The commands of a Markdown page's fenced blocks (see the module docstring)."""
    commands, block, language = [], None, ""
    for line in text.splitlines():
        fence = FENCE.match(line)
        if fence and block is None:
            block, language = [], fence.group(1).lower()
        elif fence:
            if language in SHELL_LANGUAGES:
                commands += commands_in_lines(block, all_commands=True, console=language == "console")
            elif not language:
                commands += commands_in_lines(block, all_commands=False)
            block = None
        elif block is not None:
            block.append(line)
    return commands


def commands_in_example_header(path: Path) -> list[str]:
    """A script's module docstring or a config's leading comment: its lines that begin with a command."""
    if path.suffix == ".py":
        lines = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").splitlines()
    else:
        source = path.read_text(encoding="utf-8").splitlines()
        lines = [line[1:] for line in source[: next(i for i, line in enumerate(source) if not line.startswith("#"))]]
    return commands_in_lines(lines, all_commands=False)


def commands_in_hints(hints: str) -> list[str]:
    """The quickstart's closing hints: one command a line, its note after three spaces in parentheses."""
    lines = hints.splitlines()[1:]  # after "next:"
    return [re.split(r"\s{3,}\(", line.strip())[0] for line in lines if not line.strip().startswith("(")]


def _simple_commands(command: str) -> list[list[str]]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words, parts = list(lexer), [[]]
    for word in words:
        if word in SEPARATORS:
            parts.append([])
        else:
            parts[-1].append(word)
    return [part for part in parts if part]


def _tracked_directories() -> set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {path.split("/", 1)[0] for path in listed.splitlines() if "/" in path}


TRACKED_DIRECTORIES = _tracked_directories()


def _repository_path_problem(argument: str) -> str | None:
    value = argument.split("=", 1)[1] if argument.startswith("--") and "=" in argument else argument
    if value.split("/", 1)[0] not in TRACKED_DIRECTORIES or "/" not in value:
        return None
    exists = any(REPO.glob(value)) if any(c in value for c in "*?[") else (REPO / value).exists()
    return None if exists else f"{value} is not a path of the repository"


def _module_exists(name: str) -> bool:
    sys.path.insert(0, str(REPO))  # python -m runs from the repository root, which is on its path
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    finally:
        sys.path.remove(str(REPO))


def _executable_problem(executable: str, arguments: list[str]) -> str | None:
    if executable.startswith(".venv/bin/"):
        return None if (REPO / executable).is_file() else f"{executable} is not installed by the README's set-up"
    if executable.startswith("/"):
        return None if Path(executable).is_file() else f"{executable} does not exist"
    if executable == "python3" and arguments[:2] == ["-m", "venv"]:
        return None
    if executable in SYSTEM_COMMANDS - {"python3"}:
        return None
    return f"{executable} is not on a fresh machine: write .venv/bin/{executable}"


def _script_of(name: str, arguments: list[str]) -> str | None:
    """The script a ``python`` or ``torchrun`` command runs (none for ``-m`` and ``-c``)."""
    if name == "torchrun":
        return next((a for a in arguments if a.endswith(".py")), None)
    if arguments[:1] in (["-m"], ["-c"]):
        return None
    return next((a for a in arguments if not a.startswith("-")), None)


def problems_of(command: str) -> list[str]:
    """Why ``command`` would not run as written from the repository root after the README's set-up (none: it does)."""
    problems = []
    for words in _simple_commands(command):
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if not words:
            continue
        executable, arguments = words[0], words[1:]
        name = Path(executable).name
        found = [_executable_problem(executable, arguments)]
        if name == "hp-data" and arguments and arguments[0] not in {"-h", "--help", "help"}:
            found.append(None if arguments[0] in COMMANDS else f"hp-data has no command {arguments[0]!r}")
        if name in PYTHONS and arguments[:1] == ["-m"] and len(arguments) > 1 and not _module_exists(arguments[1]):
            found.append(f"python -m {arguments[1]}: no such module")
        script = _script_of(name, arguments) if name in PYTHONS | {"torchrun"} else None
        if script is not None and not (REPO / script).is_file():
            found.append(f"{name} {script}: no such file in the repository")
        found += [_repository_path_problem(argument) for argument in arguments if argument != script]
        problems += [f"{command!r}: {problem}" for problem in found if problem]
    return problems


# -- the checker itself -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/hp-data quickstart",
        "FOO=1 HF_HUB_OFFLINE=1 .venv/bin/python -m hyper_parallel.data.tools.cli --help | head -3",
        ".venv/bin/python -m benchmarks --quick; .venv/bin/python examples/train_tiny_gpt.py --steps 2",
        ".venv/bin/torchrun --nproc-per-node 4 examples/train_tiny_gpt.py  # a comment: python nope.py",
        ".venv/bin/hp-data preview examples/conversation_sft.yaml --tokenizer hyper_parallel/data/assets/tokenizer",
        ".venv/bin/hp-data inspect out/corpus_text_document --verify && git status",
        ".venv/bin/python -m hyper_parallel.data.tools.offline_preparation --dataset-name-or-path 'examples/*.yaml'",
    ],
)
def test_the_checker_passes_commands_that_run_as_written(command):
    assert problems_of(command) == []


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("python examples/train_tiny_gpt.py", "python is not on a fresh machine: write .venv/bin/python"),
        ("pip install -e .", "write .venv/bin/pip"),
        ("python3 -m pytest", "python3 is not on a fresh machine"),
        ("torchrun --nproc-per-node 4 examples/train_tiny_gpt.py", "write .venv/bin/torchrun"),
        ("hp-data quickstart", "write .venv/bin/hp-data"),
        ("FOO=1 python -m benchmarks", "write .venv/bin/python"),
        ("cd docs && ruff check .", "write .venv/bin/ruff"),
        ("cat README.md | pytest -q", "write .venv/bin/pytest"),
        (".venv/bin/hp-data prepair --help", "hp-data has no command 'prepair'"),
        (".venv/bin/python -m hyper_parallel.data.tools.no_such_tool", "no such module"),
        (".venv/bin/python examples/no_such_example.py", "no such file in the repository"),
        (".venv/bin/torchrun --nproc-per-node 2 examples/missing.py", "torchrun examples/missing.py: no such file"),
        (".venv/bin/hp-data preview examples/missing.yaml", "examples/missing.yaml is not a path of the repository"),
        (".venv/bin/hp-data inspect x --tokenizer=hyper_parallel/data/assets/nope", "is not a path of the repository"),
        (".venv/bin/no-such-tool --help", ".venv/bin/no-such-tool is not installed"),
    ],
)
def test_the_checker_names_what_would_not_run(command, problem):
    found = problems_of(command)
    assert len(found) == 1 and problem in found[0], found


def test_the_extraction_follows_fences_continuations_consoles_and_untagged_blocks():
    page = "\n".join(
        [
            "```bash",
            "# a comment line",
            ".venv/bin/hp-data prepare --json-keys text \\",
            "    --append-eod true",
            "python nope.py",
            "```",
            "```python",
            "python = 3  # code, not a command",
            "```",
            "```",
            "input_ids   [[3, 4, 5]]",
            "hp-data inspect x",
            "```",
            "```console",
            "$ .venv/bin/hp-data --help",
            "usage: hp-data COMMAND",
            "```",
            "  ```sh",
            "  torchrun train.py",
            "  ```",
        ]
    )
    commands = commands_in_markdown(page)
    assert commands == [
        ".venv/bin/hp-data prepare --json-keys text --append-eod true",
        "python nope.py",
        "hp-data inspect x",
        ".venv/bin/hp-data --help",
        "torchrun train.py",
    ]
    assert [problem for command in commands for problem in problems_of(command)] == [
        "'python nope.py': python is not on a fresh machine: write .venv/bin/python",
        "'python nope.py': python nope.py: no such file in the repository",
        "'hp-data inspect x': hp-data is not on a fresh machine: write .venv/bin/hp-data",
        "'torchrun train.py': torchrun is not on a fresh machine: write .venv/bin/torchrun",
        "'torchrun train.py': torchrun train.py: no such file in the repository",
    ]


def test_the_hints_extraction_drops_the_notes():
    hints = "next:\n  .venv/bin/hp-data prepare --help   (tokenize; your own files)\n      (a note: python x)\n"
    assert commands_in_hints(hints) == [".venv/bin/hp-data prepare --help"]


# -- the documentation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_command_of_the_docs_runs_as_written(page):
    commands = commands_in_markdown(page.read_text(encoding="utf-8"))
    assert [problem for command in commands for problem in problems_of(command)] == []


def test_the_docs_show_commands_to_check():
    """The extraction finds the commands the pages are known to hold, so the test above is not vacuous."""
    readme = commands_in_markdown((REPO / "README.md").read_text(encoding="utf-8"))
    assert readme[:2] == [
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/hp-data quickstart",
        'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[test]" && .venv/bin/ruff check . && '
        ".venv/bin/python -m pytest",
    ]
    counts = {page.name: len(commands_in_markdown(page.read_text(encoding="utf-8"))) for page in DOCS}
    assert counts["tools.md"] >= 8 and counts["examples.md"] >= 8 and counts["offline.md"] >= 1


@pytest.mark.parametrize("path", EXAMPLE_HEADERS, ids=lambda path: path.name)
def test_every_command_of_the_examples_headers_runs_as_written(path):
    commands = commands_in_example_header(path)
    assert [problem for command in commands for problem in problems_of(command)] == []


def test_the_examples_headers_show_their_commands():
    found = {path.name: commands_in_example_header(path) for path in EXAMPLE_HEADERS}
    assert len(found["train_tiny_gpt.py"]) == 7
    assert all(any("hp-data preview" in command for command in found[name]) for name in found if ".yaml" in name)


def test_every_command_of_the_quickstarts_closing_hints_runs_as_written():
    commands = commands_in_hints(closing_hints(Path("quickstart_output") / "corpus_text_document"))
    assert len(commands) == 4
    assert [problem for command in commands for problem in problems_of(command)] == []


# -- what the examples and tools write by default -----------------------------------------------------------------

# Folders the code writes into the repository root when run as documented: the quickstart's default --output-dir
# (the example configs read it) and the training example's documented --save-dir.
DEFAULT_OUTPUTS = ["quickstart_output", "checkpoints"]


def test_the_default_output_folders_are_the_codes():
    quickstart = (REPO / "hyper_parallel" / "data" / "tools" / "quickstart.py").read_text(encoding="utf-8")
    assert '"--output-dir", default="quickstart_output"' in quickstart
    documented = [c for c in commands_in_example_header(REPO / "examples" / "train_tiny_gpt.py") if "--save-dir" in c]
    assert {shlex.split(c)[shlex.split(c).index("--save-dir") + 1] for c in documented} == {"checkpoints"}


@pytest.mark.parametrize("folder", DEFAULT_OUTPUTS)
def test_git_ignores_every_default_output_folder(folder):
    for path in (f"{folder}/", f"{folder}/any/file.bin"):
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, check=False)
        assert ignored.returncode == 0, f"{path} is not in .gitignore"
