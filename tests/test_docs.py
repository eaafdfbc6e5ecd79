"""Every example in the README and docs/ runs, or says why it cannot (docs/testing.md, "The docs' examples").

Each fenced block a user can paste is covered: a command is checked without running it (its options exist in its
parser, its model_args pass the checks the model makes before loading, its tasks and config files exist and load),
then run here (fast), in the slow tier (it loads a model), by the script or test an HTML comment right before it
names (`<!-- run by FILE -->`), or marked `<!-- not run: REASON -->`. Relative links and their anchors resolve, and
the tables that list options list exactly what the code has. A renamed option or a moved page turns the fast tier
red.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import functools
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(not run:\s*\S.*?|run by \S+|run in the slow tier)\s*-->$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
SHELL = {"", "sh", "bash", "shell"}
OUTPUT = {"text", "console", "output"}
# where a repository path written in inline code may start (results/ and the like are made by the runs)
REPO_PATHS = ("configs/", "scripts/", "benchmarks/", "tests/", "docs/", "alspec_eval/", "kernels/", "tasks/",
              "notebooks/", ".ci/")


# ---------------------------------------------------------------------------------------------- the documents


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its info string, its text and the HTML comment right before it."""

    path: Path
    line: int
    info: str
    text: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a Markdown file's lines outside fenced blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match[2]
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            yield number, line


def blocks(path: Path) -> list[Block]:
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(before)
        end = next(k for k in range(i + 1, len(lines)) if lines[k].strip().startswith(match[2])
                   and not lines[k].strip().strip(match[2][0]))
        body = "\n".join(line[len(match[1]):] for line in lines[i + 1:end])
        found.append(Block(path, i + 1, match[3].lower(), body, marker and marker[1]))
        i = end + 1
    return found


BLOCKS = [block for path in DOCS for block in blocks(path)]


def defined_files(path: Path) -> dict[str, str]:
    """The files a page writes out for its commands: YAML blocks whose first line is `# NAME.yaml` (not a file of
    the repository)."""
    files = {}
    for block in blocks(path):
        first = block.text.splitlines()[0] if block.text else ""
        if block.info == "yaml" and (m := re.fullmatch(r"#\s*(\S+\.ya?ml)", first.strip())) \
                and not (ROOT / m[1]).exists():
            files[m[1]] = block.text
    return files


# ---------------------------------------------------------------------------------------------- what the code has


@functools.cache
def console_scripts() -> dict[str, str]:
    """setup.cfg's commands: name -> module."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return {name.strip(): target.strip().split(":")[0] for name, target in (line.split("=") for line in lines)}


@functools.cache
def extras() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return set(config["options.extras_require"])


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    """Module -> its argparse parser (the commands' own, so a renamed option fails here)."""
    from lm_eval._cli.harness import HarnessCLI

    from alspec_eval import latency_cli
    from alspec_eval.approx_check import cli as check_cli
    from alspec_eval.niah import cli as niah_cli
    from alspec_eval.report import cli as report_cli
    from alspec_eval.sweep import cli as sweep_cli
    from alspec_eval.tune import cli as tune_cli

    return {"lm_eval": lambda: HarnessCLI()._subparsers.choices["run"], "alspec_eval.sweep.cli": sweep_cli.parser,
            "alspec_eval.report.cli": report_cli._parser, "alspec_eval.niah.cli": niah_cli.parser,
            "alspec_eval.latency_cli": latency_cli._parser, "alspec_eval.tune.cli": tune_cli.parser,
            "alspec_eval.approx_check.cli": check_cli.parser}


@functools.cache
def known_tasks() -> frozenset[str]:
    """Task, group and tag names of lm-eval's task folders and the bundled tasks/, read from their YAML files as
    text (lm-eval's own index takes 10 s to build)."""
    import lm_eval

    names: set[str] = set()
    scalar = re.compile(r"^\s*(?:task|group|tag)\s*:\s*[\"']?([\w.\-]+)", re.M)
    listed = re.compile(r"^\s*(?:tag|task)\s*:\s*\n((?:\s*-\s*[\"']?[\w.\-]+[\"']?\s*\n)+)", re.M)
    for folder in (Path(lm_eval.__file__).parent / "tasks", ROOT / "tasks"):
        for path in folder.rglob("*.yaml"):
            text = path.read_text(errors="ignore")
            names.update(scalar.findall(text))
            for items in listed.findall(text):
                names.update(re.findall(r"-\s*[\"']?([\w.\-]+)", items))
    return frozenset(names)


def check_tasks(tasks: list[str]) -> None:
    unknown = [t for t in tasks if t.split("@")[0] not in known_tasks()]
    assert not unknown, f"unknown tasks {unknown}: not in lm-eval's task folders or tasks/"


def check_model_args(model: str, given: str | dict) -> None:
    """What the model checks before anything loads (adapter.ALSpecLM, vllm.model.ALSpecVLLM)."""
    from lm_eval.utils import simple_parse_args_string

    from alspec_eval.backends import load_backend
    from alspec_eval.config import SpeculationConfig

    args = dict(given) if isinstance(given, dict) else simple_parse_args_string(given)
    if model == "alspec":
        from lm_eval.models.huggingface import HFLM

        config, _ = SpeculationConfig.from_model_args(args, set(inspect.signature(HFLM.__init__).parameters))
        if config.backend == "sim":  # tt's constructor checks for ttnn
            load_backend(config)
    elif model == "alspec-vllm":
        from alspec_eval.vllm.checks import check_engine_args, check_speculation

        config, rest = SpeculationConfig.from_model_args(args)
        check_speculation(args, config)
        check_engine_args(rest)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse's result, or its one-line error as a test failure."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{parser.prog} {shlex.join(argv)}: {err.getvalue().strip().splitlines()[-1]}") from None


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


# ---------------------------------------------------------------------------------------------- commands


@dataclass
class Command:
    """One command of a block, resolved: the program (a module with a parser, or a file), its arguments."""

    text: str
    env: dict[str, str]
    program: str  # "lm_eval", a module of _parsers(), "pip", "script", or the first word
    argv: list[str]
    model: str | None = None  # alspec-eval run's default model
    file: Path | None = None  # a script's


def split_commands(text: str) -> list[list[str]]:
    """A block's commands as a shell splits them: continuations joined, comments dropped, split at ; && || |."""
    text = re.sub(r"\\\n", " ", text)
    commands: list[list[str]] = []
    for line in text.splitlines():
        line = re.sub(r"^\$ ", "", line.strip())
        if not line or line.startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        current: list[str] = []
        for token in lexer:
            if token in (";", "&&", "||", "|"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def resolve(words: list[str]) -> Command:
    text = shlex.join(words)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words[0].split("=", 1)
        env[key], words = value, words[1:]
    if not words:  # only settings, as `ALSPEC_SKIP_TT=1`
        return Command(text, env, "", [])
    head, rest = os.path.basename(words[0]), words[1:]
    if head == "accelerate" and rest[:1] == ["launch"]:
        rest = rest[rest.index("-m"):] if "-m" in rest else rest[1:]
        head = "python"
    if head in ("python", "python3") and rest[:2] == ["-m", "pip"]:
        head, rest = "pip", rest[2:]
    if head in ("python", "python3") and rest:
        if rest[:1] == ["-m"]:
            module, rest = rest[1], rest[2:]
            if module == "alspec_eval":  # python -m alspec_eval run ...: alspec-eval
                return _alspec_eval(text, env, rest)
            if module in ("lm_eval", "pytest") or module in _parsers():
                return Command(text, env, module, rest)
            try:
                spec = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                spec = None
            assert spec and spec.origin, f"{text}: no module {module}"
            return Command(text, env, "script", rest, file=Path(spec.origin))
        return Command(text, env, "script", rest[1:], file=ROOT / rest[0])
    if head == "bash":
        return Command(text, env, "script", rest[1:], file=ROOT / rest[0])
    if head in ("lm_eval", "lm-eval"):
        return Command(text, env, "lm_eval", rest)
    if head == "alspec-eval":
        return _alspec_eval(text, env, rest)
    if head in console_scripts():
        return Command(text, env, console_scripts()[head], rest)
    return Command(text, env, head, rest)


def _alspec_eval(text: str, env: dict[str, str], rest: list[str]) -> Command:
    if rest[:1] != ["run"]:  # alspec-eval's one command is run
        return Command(text, env, "alspec-eval", rest)
    return Command(text, env, "lm_eval", rest[1:], model="alspec")


@dataclass
class Context:
    """What a block's commands may refer to besides the repository: the files its page writes out."""

    files: dict[str, str] = field(default_factory=dict)

    def config(self, name: str, overrides: dict | None = None) -> Any:
        from alspec_eval.sweep.config import load_config, parse_config

        if name in self.files:
            return parse_config({**yaml.safe_load(self.files[name]), **(overrides or {})}, source=name)
        assert (ROOT / name).is_file(), f"{name} does not exist"
        return load_config(ROOT / name, overrides)


def check_command(command: Command, context: Context) -> None:
    """Everything a command's text can tell without running it."""
    program, argv = command.program, command.argv
    if program == "pip":
        check_pip(command)
    elif program == "script":
        assert command.file is not None and command.file.is_file(), f"{command.text}: {command.file} does not exist"
        text = command.file.read_text()
        missing = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in text]
        assert not missing, f"{command.text}: {command.file.name} takes no {missing}"
    elif program == "lm_eval":
        args = parse(_parsers()["lm_eval"](), ["--model", command.model, *argv] if command.model and
                     "--model" not in argv else argv)
        check_model_args(args.model, args.model_args or {})
        tasks = args.tasks if isinstance(args.tasks, list) else [args.tasks] if args.tasks else []
        check_tasks([name for given in tasks for name in given.split(",")])
    elif program in _parsers():
        args = parse(_parsers()[program](), argv)
        check_alspec_command(program, args, context)
    elif program == "pytest":  # its options come from plugins: the paths it is given exist
        paths = [a for a in argv if not a.startswith("-") and ("/" in a or a.endswith(".py"))]
        assert all((ROOT / p.split("::")[0]).exists() for p in paths), f"{command.text}: {paths}"
    elif program not in ("mkdir",):
        raise AssertionError(f"{command.text}: {program} is no command this test knows")


def check_alspec_command(program: str, args: argparse.Namespace, context: Context) -> None:
    from alspec_eval.config import SpeculationConfig
    from alspec_eval.sweep.config import ENGINES, parse_model_args

    if program == "alspec_eval.sweep.cli":
        overrides = {k: v for k, v in {"output": args.output, "limit": args.limit, "batch_size": args.batch_size,
                                       "device": args.device}.items() if v is not None}
        if args.model:
            overrides.update(model=args.model, engine={m: e for e, m in ENGINES.items()}[args.model])
        if "limit" in overrides and overrides["limit"].is_integer():
            overrides["limit"] = int(overrides["limit"])
        config = context.config(args.config, overrides)
        model_args = {**config.model_args, **parse_model_args(args.model_args or "")}
        check_model_args(ENGINES[config.engine], ",".join(f"{k}={v}" for k, v in model_args.items()))
        check_tasks(config.tasks)
    elif program == "alspec_eval.tune.cli":
        if args.config:
            check_tasks(context.config(args.config).tasks)
        if args.tasks:
            check_tasks(args.tasks.split(","))
        check_model_args("alspec", args.model_args or "")
    elif program == "alspec_eval.niah.cli":
        check_model_args("alspec", args.model_args)
        given = dict(item.split("=", 1) for item in args.approx_args)
        for name in args.approx.split(","):
            SpeculationConfig(approx=name, approx_args=given.get(name), window=args.window)
    elif program == "alspec_eval.approx_check.cli":
        if ":" in args.approx and "." not in args.approx.split(":")[0]:  # a module on PYTHONPATH (tests/)
            module = args.approx.split(":")[0]
            assert (ROOT / "tests" / f"{module}.py").is_file(), f"no {module} in tests/"
        else:
            SpeculationConfig(approx=args.approx, approx_args=args.approx_args, window=args.window)


def check_pip(command: Command) -> None:
    """Extras setup.cfg has; a pinned version the project pins the same way (setup.cfg, scripts/bootstrap.sh)."""
    pins = (ROOT / "setup.cfg").read_text() + (ROOT / "scripts" / "bootstrap.sh").read_text()
    for word in command.argv:
        if match := re.fullmatch(r"(alspec-eval|\.)\[([\w,-]+)\]", word):
            unknown = set(match[2].split(",")) - extras()
            assert not unknown, f"{command.text}: setup.cfg has no extra {sorted(unknown)}"
        elif match := re.fullmatch(r"([\w.-]+)==([\w.]+)", word):
            if re.search(rf"\b{re.escape(match[1])}\b", pins):
                assert match[2] in pins, f"{command.text}: the project pins {match[1]} otherwise"


def script_commands(text: str) -> list[list[str]]:
    """A script's lines as words (continuations joined, the venv's bin folder dropped); lines shlex cannot split
    (bash's own syntax) as they are."""
    lines = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            words = list(lexer)
        except ValueError:
            words = line.split()
        lines.append([w.removeprefix(".venv/bin/") for w in words])
    return lines


def runs(script: list[list[str]], words: list[str]) -> bool:
    """Whether a line of the script holds these words in a row."""
    n = len(words)
    return any(line[i:i + n] == words for line in script for i in range(len(line) - n + 1))


def run_fast(command: Command) -> None:
    """The commands that run here in a moment, in this process: alspec-latency."""
    from alspec_eval import latency_cli

    assert command.program == "alspec_eval.latency_cli", (
        f"{command.text}: neither run here nor marked: run it in the slow tier (<!-- run in the slow tier -->), "
        "name what runs it (<!-- run by FILE -->) or say why not (<!-- not run: REASON -->)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = latency_cli.main(command.argv)
    assert not code and out.getvalue(), command.text


# Commands that a slow test runs in an equivalent form: the command -> the check that it does.
def _check_approx_on_every_registered(test: str) -> None:
    from alspec_eval.approx_check.cli import FAMILIES, parser
    from default_approximations import approx_args

    args = parser().parse_args(["quest", "--approx_args", "page:4"])
    assert approx_args("quest", args.window) == {"approx": "quest", "approx_args": args.approx_args}
    assert args.families == ",".join(FAMILIES) and 'check(approx, 8, ["llama", "qwen2", "gemma2"])' in test
    assert args.window == 8


def _check_approx_broken(test: str) -> None:
    assert '_run("broken_approximation:PeeksAhead", "--families", "llama,gemma2")' in test and "PYTHONPATH" in test


def _report_on_a_synthetic_sweep(test: str) -> None:
    from alspec_eval.report import cli

    args = cli._parser().parse_args(["results/demo"])
    assert (args.preset, args.latency, args.paper, args.lam) == (None, None, "auto", None)
    assert "write_report(args.outdir, specs or None, args.paper, args.lam)" in inspect.getsource(cli.main)
    assert "write_report(sweep_dir)" in test


COVERED = {"alspec-report results/demo": _report_on_a_synthetic_sweep,
           "alspec-check-approx quest --approx_args page:4": _check_approx_on_every_registered,
           "PYTHONPATH=tests alspec-check-approx broken_approximation:PeeksAhead --families llama": _check_approx_broken}


# ---------------------------------------------------------------------------------------------- fenced blocks


def exec_python(block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A Python block as a user runs it: its own module, in a folder with a sweep's output at results/demo, and
    approximations it registers gone afterwards."""
    from alspec_eval.approximations import catalog

    if "results/demo" in block.text:
        spec = importlib.util.spec_from_file_location("docs_synthetic_sweep", ROOT / "tests/report/synthetic_sweep.py")
        synthetic = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(synthetic)
        synthetic.write_sweep(tmp_path / "results" / "demo", documents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(catalog.APPROXIMATIONS, "_entries", dict(catalog.APPROXIMATIONS._entries))
    module = types.ModuleType("docs_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block.text, block.where, "exec"), module.__dict__)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_every_block_runs_or_says_why_not(block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each fenced block a user can paste is checked, then run here, in the slow tier, by what its marker names, or
    marked with the reason it cannot run here."""
    marker = block.marker or ""
    if block.info in OUTPUT:
        return
    if block.info == "json":  # a lambda_schedule file: loaded as lambda_schedule= loads it
        from alspec_eval.schedule import LambdaSchedule

        (tmp_path / "schedule.json").write_text(block.text)
        LambdaSchedule.load(tmp_path / "schedule.json")
        return
    if block.info == "yaml":
        check_yaml(block)
        return
    if block.info == "python":
        if not marker:
            exec_python(block, monkeypatch, tmp_path)
        return
    assert block.info in SHELL, f"{block.where}: info string {block.info!r}: use sh, yaml, python, json or text"
    context = Context(defined_files(block.path))
    commands = [resolve(words) for words in split_commands(block.text)]
    assert commands, f"{block.where}: an empty block"
    for command in commands:
        assert not re.search(r"(^|\s)\[-", command.text), f"{block.where}: {command.text}: [optional] is not shell"
        check_command(command, context)
        if command.program == "pip":
            assert marker.startswith("not run"), f"{block.where}: pip installs from the registry: mark it not run"
    if marker.startswith("run by "):
        check_run_by(block, marker.removeprefix("run by "), commands)
    elif not marker:
        for command in commands:
            run_fast(command)


def check_yaml(block: Block) -> None:
    """A sweep config: loaded through the project's loader; `# FILE` first names the file it is."""
    from alspec_eval.sweep.config import parse_config

    data = yaml.safe_load(block.text)
    first = block.text.splitlines()[0].strip()
    if (m := re.fullmatch(r"#\s*(\S+\.ya?ml)", first)) and (ROOT / m[1]).exists():
        assert data == yaml.safe_load((ROOT / m[1]).read_text()), f"{block.where}: differs from {m[1]}"
    assert isinstance(data, dict) and {"name", "tasks", "lambdas"} <= set(data), \
        f"{block.where}: a YAML block is a sweep config (name, tasks, lambdas)"
    config = parse_config(data, source=block.where)
    check_tasks(config.tasks)


def check_run_by(block: Block, runner: str, commands: list[Command]) -> None:
    """The file named runs these commands: a script holds each one; a test is in COVERED with how it runs it."""
    path = ROOT / runner
    assert path.is_file(), f"{block.where}: run by {runner}, which does not exist"
    if path.suffix == ".py":
        for command in commands:
            assert command.text in COVERED, f"{block.where}: say in COVERED how {runner} runs {command.text}"
            COVERED[command.text](path.read_text())
        return
    script = script_commands(path.read_text())
    for command in commands:
        words = [w.removeprefix(".venv/bin/") for w in shlex.split(command.text)]
        assert runs(script, words), f"{block.where}: {runner} does not run {command.text}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "run in the slow tier"], ids=lambda b: b.where)
def test_slow_blocks_run(block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The blocks that load a model, run as written in an empty folder."""
    if block.info == "python":
        exec_python(block, monkeypatch, tmp_path)
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    for words in split_commands(block.text):
        run = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert run.returncode == 0, f"{block.where}: {shlex.join(words)}\n{run.stderr[-3000:]}"
        command = resolve(words)
        if command.program == "lm_eval":
            output = Path(command.argv[command.argv.index("--output_path") + 1])
            (sidecar,) = (tmp_path / output).rglob("alspec_*.json")
            assert json.loads(sidecar.read_text())["schema_version"] == 2


# ---------------------------------------------------------------------------------------------- links and prose


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m[1] or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _outside_fences(path.read_text()):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m[1])
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    broken = []
    for number, line in _outside_fences(path.read_text()):
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{number}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{number}: {target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def inline_code(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in _outside_fences(path.read_text()):
        for _, code in re.findall(r"(`+)(.+?)\1", line):
            yield number, code.strip().strip("`").strip()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_inline_commands_and_paths_exist(path: Path) -> None:
    """A command in inline code names options its parser has; a repository path in inline code exists."""
    wrong = []
    for number, code in inline_code(path):
        if code.startswith(REPO_PATHS) and not re.search(r"[<*{ ]|\.\.\.", code):
            path_in_repo = ROOT / code.split(":")[0]
            if path_in_repo.parent.is_dir() and not path_in_repo.exists():  # (another repository's path: no folder)
                wrong.append(f"{number}: {code} does not exist")
            continue
        if "..." in code:  # a fragment
            continue
        try:
            words = split_commands(code.replace("[", " ").replace("]", " ").replace("|", " "))
            command = resolve(words[0]) if words else None
        except (ValueError, AssertionError):
            continue
        if command is None:
            continue
        if command.program == "pip":
            try:
                check_pip(command)
            except AssertionError as err:
                wrong.append(f"{number}: {err}")
        elif command.program == "lm_eval" or command.program in _parsers():
            flags = {a.split("=")[0] for a in command.argv if a.startswith("--")}
            unknown = flags - options(_parsers()[command.program]())
            wrong += [f"{number}: {code}: no option {sorted(unknown)}"] if unknown else []
        elif command.program == "script" and command.file is not None:
            if not command.file.is_file():
                wrong.append(f"{number}: {code}: {command.file.relative_to(ROOT)} does not exist")
            else:
                missing = [a for a in command.argv if a.startswith("--") and a not in command.file.read_text()]
                wrong += [f"{number}: {code}: no option {missing}"] if missing else []
    assert not wrong, f"{path.relative_to(ROOT)}:\n" + "\n".join(wrong)


def test_no_command_hides_in_an_indented_block() -> None:
    """Indented code blocks escape the checks above: commands go in fenced blocks."""
    pattern = re.compile(r"^ {4,}(\$ |lm_eval |alspec-|bash |pip |python |accelerate )")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in DOCS for n, line in _outside_fences(path.read_text())
             if pattern.match(line)]
    assert not found, found


def test_dates_and_timings_live_in_results() -> None:
    """Dated notes go stale: dates only in docs/results.md; a timing in the README links to it on its line or the
    next; the other pages hold none (paper.md and latency.md quote the paper's microseconds)."""
    timing = re.compile(r"\b\d+(?:\.\d+)?(?:\s*(?:to|-)\s*\d+(?:\.\d+)?)?\s*(?:ms|us|seconds|minutes|min|hours|s)\b")
    found = []
    for path in DOCS:
        if path.name == "results.md":
            continue
        lines = path.read_text().splitlines()
        for number, line in _outside_fences(path.read_text()):
            prose = re.sub(r"`[^`]*`", "", line)
            if re.search(r"\b20\d\d-\d\d-\d\d\b", prose):
                found.append(f"{path.name}:{number}: a date")
            if path.name not in ("paper.md", "latency.md") and timing.search(prose) and not (
                    path.name == "README.md" and "results.md" in " ".join(lines[number - 1:number + 1])):
                found.append(f"{path.name}:{number}: {timing.search(prose)[0]}")
    assert not found, found


def test_every_result_has_its_date_commit_and_machine() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0]
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), f"results.md, {title}: no date"
        assert re.search(r"\b[0-9a-f]{7}\b", section), f"results.md, {title}: no commit"
        assert re.search(r"AMD EPYC|H100|H200|on the CPU", section), f"results.md, {title}: no machine"


@pytest.mark.slow
def test_the_commits_results_name_exist() -> None:
    """Starts git (slow tier): every commit docs/results.md names is in the repository's history (a shallow clone
    holds too little of it to say)."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: the history is not here to check")
    commits = set(re.findall(r"\b[0-9a-f]{7}\b", (ROOT / "docs" / "results.md").read_text()))
    missing = [c for c in sorted(commits) if subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=ROOT,
                                                           capture_output=True).returncode]
    assert not missing, missing


# ---------------------------------------------------------------------------------------------- tables against code


def table_column(path: Path, header: str) -> list[str]:
    """The first column (inline code) of the Markdown table whose header row starts with `header`."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(re.findall(r"`([^`]+)`", line.split("|")[1])[0])
    return rows


def test_the_model_args_table_lists_every_option() -> None:
    from alspec_eval.config import MODEL_ARGS

    assert sorted(table_column(ROOT / "docs" / "model_args.md", "arg")) == sorted(set(MODEL_ARGS) - {"lam"})


def test_the_sweep_keys_table_lists_every_key() -> None:
    from alspec_eval.sweep.config import SweepConfig

    assert sorted(table_column(ROOT / "docs" / "sweeps.md", "key")) == sorted(
        [f.name for f in fields(SweepConfig)] + ["approx_args", "model"])


def test_the_readme_names_every_command_engine_and_page() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = {c.split()[0] for c in table_column(ROOT / "README.md", "command")}
    assert set(console_scripts()) | {"lm_eval"} == commands
    assert {"alspec", "alspec-vllm"} == set(table_column(ROOT / "README.md", "`--model`"))
    unlinked = sorted(p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme)
    assert not unlinked, f"pages of docs/ the README does not link: {unlinked}"


def test_the_readme_is_the_entrance() -> None:
    """The two fresh-machine commands stay as they are, and the README stays short (the rest is in docs/)."""
    readme = (ROOT / "README.md").read_text()
    assert "```sh\nbash scripts/demo.sh\n```" in readme and "```sh\nbash scripts/test.sh\n```" in readme
    assert len(readme.splitlines()) <= 220


def test_docs_write_policy_always() -> None:
    """`sink` names the approximation and the paper's row; the policy is `always`, its old name said once."""
    uses = [f"{p.name}:{n}" for p in DOCS for n, line in enumerate(p.read_text().splitlines(), 1)
            if "policy=sink" in line]
    assert len(uses) == 1 and uses[0].startswith("model_args.md:"), uses


def test_the_latency_table_is_what_the_model_computes() -> None:
    from alspec_eval.latency import full_tp, preset, project

    rows = [line.split("|")[1:-1] for line in (ROOT / "docs" / "latency.md").read_text().splitlines()
            if re.match(r"\| (h100|n150)-", line)]
    assert len(rows) == 6
    for name, rate, full, alspec, speedup in ([c.strip() for c in row] for row in rows):
        model = preset(name.split()[0])
        got = project(model, float(rate))
        decimals = len(full.split(".")[1])
        assert (round(full_tp(model).tokens_per_s, decimals), round(got.tokens_per_s, decimals),
                round(got.speedup, 3)) == (float(full), float(alspec), float(speedup)), name


def test_the_layout_names_files_that_exist() -> None:
    """docs/architecture.md's tree: each file or folder at the head of an entry exists where the tree puts it."""
    tree = next(b.text for b in blocks(ROOT / "docs" / "architecture.md") if b.text.startswith("alspec_eval/"))
    parents: dict[int, Path] = {}
    missing = []
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        word = line.split()[0] if line.strip() else ""
        if indent >= 10 or not (word.endswith("/") or word.endswith(".py")):
            continue
        base = parents.get(indent - 2, ROOT) if indent else ROOT
        if not (base / word).exists():
            missing.append(str((base / word).relative_to(ROOT)))
        parents[indent] = base / word
    assert not missing, missing


def test_the_vllm_venv_is_built_as_the_install_says() -> None:
    """The tests of --model alspec-vllm run in .venv-vllm, built by scripts/vllm_env.sh with the very commands the
    README and docs/vllm.md give a user (from the clone: the package as `-e .`), so they test what a user gets."""
    script = script_commands((ROOT / "scripts" / "vllm_env.sh").read_text())
    marked = [b for b in BLOCKS if "vllm_env.sh builds .venv-vllm with exactly these lines" in (b.marker or "")]
    assert {b.path.name for b in marked} == {"README.md", "vllm.md"}
    for block in marked:
        for words in split_commands(block.text):
            words = [w for word in words for w in (["-e", ".[vllm]"] if word == "alspec-eval[vllm]" else [word])]
            assert runs(script, words), f"{block.where}: scripts/vllm_env.sh does not run {' '.join(words)}"
