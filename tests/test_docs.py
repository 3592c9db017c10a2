"""The documentation says what the code does.

- every `cudahook ...` command in a shell block of README.md or docs/ parses
  with the CLI's own parser, and its subcommand's `--help` runs;
- docs/cli.md's synopsis names every subcommand and option, and only real ones;
  every `cudahook ...` in inline code names a real subcommand and options;
- every reason code and exit code the docs name exists, and docs/cli.md
  documents every one (side and hook exit as `cudahook/platform/reasons.py`
  defines them);
- the generated parts (configuration tables, performance results) equal what
  scripts/gen-docs.py makes from the schemas and bench/results/ now;
- every relative link leads to a file (and heading) that exists.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cudahook.admin.cli import build_parser
from cudahook.platform.errors import CudahookError, Exit
from cudahook.platform.reasons import REASONS

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELL = {"sh", "bash", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|"}


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """The fenced code blocks of a page: (language, first line number, lines)."""
    out: list[tuple[str, int, list[str]]] = []
    lang, start, body = None, 0, []
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), no + 1, []
            else:
                out.append((lang, start, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """Every `cudahook` command in the page's shell blocks: (where, argv)."""
    out = []
    for lang, start, body in blocks(path):
        if lang not in SHELL:
            continue
        logical: list[tuple[int, str]] = []
        pending = ""
        for i, line in enumerate(body):
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if pending:
                pending += " " + line.strip()
            else:
                pending, first = line, start + i
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            logical.append((first, pending))
            pending = ""
        for no, line in logical:
            words = shlex.split(line, comments=True)
            segments: list[list[str]] = [[]]
            for w in words:
                if w in SEPARATORS:
                    segments.append([])
                else:
                    segments[-1].append(w)
            for seg in segments:
                while seg and (seg[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", seg[0])):
                    seg = seg[1:]
                if seg[:1] == ["cudahook"]:
                    out.append((f"{rel(path)}:{no}", seg[1:]))
    return out


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def walk(words: list[str]) -> tuple[tuple[str, ...], argparse.ArgumentParser]:
    """The subcommand path that `words` name, and its parser (options and
    their values before a subcommand are skipped)."""
    parser, path = build_parser(), ()
    skip = False
    for w in words:
        if skip:
            skip = False
            continue
        if w.startswith("-"):
            action = parser._option_string_actions.get(w)
            skip = action is not None and action.nargs != 0 and "=" not in w
            continue
        subs = subparsers(parser)
        if w in subs:
            parser, path = subs[w], (*path, w)
        elif subs:
            raise AssertionError(f"no subcommand {w!r} after {' '.join(('cudahook', *path))}")
        else:
            break
    return path, parser


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = subparsers(parser)
    if not subs:
        yield path, parser
    for name, sub in subs.items():
        yield from leaves(sub, (*path, name))


COMMANDS = [c for page in PAGES for c in shell_commands(page)]


def test_the_docs_show_commands() -> None:
    shown = {tuple(argv[:1]) for _, argv in COMMANDS}
    assert {("demo",), ("doctor",), ("check",), ("migrate",)} <= shown, shown


@pytest.mark.parametrize("argv", [c[1] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_shown_command_parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except (CudahookError, SystemExit) as exc:
        pytest.fail(f"cudahook {shlex.join(argv)}: {exc}")


def shown_paths() -> list[tuple[str, ...]]:
    paths = set()
    for _, argv in COMMANDS:
        # No such subcommand: test_shown_command_parses names it.
        with contextlib.suppress(AssertionError):
            paths.add(walk(argv)[0])
    return sorted(paths)


PATHS = shown_paths()


@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) for p in PATHS])
def test_shown_subcommand_help_runs(path: tuple[str, ...]) -> None:
    r = subprocess.run([sys.executable, "-m", "cudahook", *path, "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: " + " ".join(("cudahook", *path))), r.stdout[:200]


def synopsis() -> dict[tuple[str, ...], set[str]]:
    """docs/cli.md's synopsis (its `text` block): the options named per path."""
    (body,) = [b for lang, _, b in blocks(REPO / "docs" / "cli.md") if lang == "text"]
    named: dict[tuple[str, ...], set[str]] = {}
    path: tuple[str, ...] = ()
    for line in body:
        if line.startswith("cudahook "):
            words = [w for w in line.split()[1:] if re.fullmatch(r"[a-z][a-z-]*", w)]
            path = walk(words)[0]
        named.setdefault(path, set()).update(re.findall(r"--[a-z][a-z-]*", line))
    return named


def test_synopsis_names_every_command_and_option() -> None:
    named = synopsis()
    common = options(build_parser())
    for path, parser in leaves(build_parser()):
        assert path in named, f"docs/cli.md: no synopsis line for cudahook {' '.join(path)}"
        for action in parser._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if not longs or action.help == argparse.SUPPRESS or set(longs) <= common:
                continue
            assert named[path] & set(longs), \
                f"docs/cli.md: cudahook {' '.join(path)} {longs[0]} is not in the synopsis"


def test_synopsis_names_only_real_options() -> None:
    common = options(build_parser())
    for path, named in synopsis().items():
        real = options(walk(list(path))[1]) | common
        assert named <= real, f"docs/cli.md: cudahook {' '.join(path)}: no {named - real}"


INLINE = re.compile(r"`(?:sudo )?cudahook ([^`]+)`")


def test_inline_commands_name_real_subcommands_and_options() -> None:
    bad = []
    for page in PAGES:
        for no, line in enumerate(page.read_text().splitlines(), 1):
            for m in INLINE.finditer(line):
                words = m.group(1).split()
                try:
                    path, parser = walk(words)
                except AssertionError as exc:
                    bad.append(f"{rel(page)}:{no}: {exc}")
                    continue
                flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", m.group(1)))
                unknown = flags - options(parser) - options(build_parser())
                if unknown:
                    bad.append(f"{rel(page)}:{no}: cudahook {' '.join(path)} has no {unknown}")
    assert not bad, "\n".join(bad)


# -- reason codes and exit codes -------------------------------------------------

SPAN = re.compile(r"`([^`]+)`")
CODE = re.compile(r"(?<![\w.$-])([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)(?![\w.-])")


def source_words() -> set[str]:
    """Upper-case names used anywhere in the code (environment variables,
    constants): a name the docs use that is neither a reason code nor one
    of these is a misspelt or stale one."""
    files = subprocess.run(["git", "ls-files", "cudahook", "hooks", "tests", "scripts", "bench",
                            "install.sh", "deploy", "config"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    words: set[str] = set()
    for name in files:
        path = REPO / name
        if path.suffix in {".py", ".sh", ".c", ".json", ".yaml", ".h", ""} and path.is_file():
            words |= set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b",
                                    path.read_text(errors="replace")))
    return words - set(REASONS)


# Names from outside the project the docs quote: CRIU's plugin hooks.
FOREIGN = {"DUMP_EXT_FILE", "RESUME_DEVICES_LATE"}


def test_every_reason_code_named_exists() -> None:
    known = set(REASONS) | {e.name for e in Exit} | source_words() | FOREIGN
    bad = [f"{rel(page)}:{no}: {code}"
           for page in PAGES
           for no, line in enumerate(page.read_text().splitlines(), 1)
           for span in SPAN.findall(line)
           for code in CODE.findall(span) if code not in known]
    assert not bad, "names that are no reason code (nor any name in the code):\n" + "\n".join(bad)


def table_rows(page: Path, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with `header`."""
    lines = page.read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith(header)]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def test_cli_md_documents_every_reason_code_as_defined() -> None:
    seen: dict[str, tuple[str, str]] = {}
    for codes, side, _what, code in table_rows(REPO / "docs" / "cli.md", "| code | side |"):
        for name in re.findall(r"`([A-Z_]+)`", codes):
            assert name not in seen, f"{name} twice in docs/cli.md"
            seen[name] = (side, code)
    assert set(seen) == set(REASONS), f"docs/cli.md vs reasons.py: {set(seen) ^ set(REASONS)}"
    for name, (side, code) in seen.items():
        reason = REASONS[name]
        assert (side, code) == (reason.side, str(int(reason.exit))), \
            f"docs/cli.md says {name}: {side}, exit {code}; reasons.py: {reason.side}, {reason.exit}"


def test_cli_md_documents_every_exit_code() -> None:
    rows = table_rows(REPO / "docs" / "cli.md", "| code | `Exit` |")
    documented = {(int(code), name.strip("`")) for code, name, _ in rows}
    assert documented == {(int(e), e.name) for e in Exit}


# Exit statuses the docs quote that are not cudahook's: nvidia-smi without a
# driver (9), a shell's report of SIGINT (130), a tool's own (the GPU
# evidence script's 3 for a missing cuda-checkpoint).
OTHER_EXITS = {9, 130}
EXIT_NAMED = re.compile(r"\bexit(?:s| status| code)? ([0-9]+)\b", re.I)


def test_every_exit_code_named_exists() -> None:
    known = {int(e) for e in Exit} | OTHER_EXITS
    bad = [f"{rel(page)}:{no}: {line.strip()}"
           for page in PAGES if page.parent.name != "gpu-evidence"
           for no, line in enumerate(page.read_text().splitlines(), 1)
           for n in EXIT_NAMED.findall(line) if int(n) not in known]
    assert not bad, "\n".join(bad)


# -- generated parts -----------------------------------------------------------


def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen-docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("part", ["configuration", "performance"])
def test_generated_part_is_current(part: str) -> None:
    path, now, want = gen_docs().expected(part)
    assert now == want, (f"{rel(path)} differs from its sources: run "
                         ".venv/bin/python scripts/gen-docs.py")


def test_configuration_page_covers_every_key() -> None:
    import json

    text = (REPO / "docs" / "configuration.md").read_text()
    for name, prefix in (("config.schema.json", ""), ("annotations.schema.json", "cudahook.io/")):
        schema = json.loads((REPO / "config" / name).read_text())
        for key in schema["properties"]:
            assert f"| `{prefix}{key}` |" in text, f"{key} missing from docs/configuration.md"


# -- links ---------------------------------------------------------------------


def anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_resolve() -> None:
    bad = []
    for page in PAGES:
        for no, line in enumerate(page.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, frag = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    bad.append(f"{rel(page)}:{no}: {target}: no such file")
                elif frag and dest.suffix == ".md":
                    heads = {anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                    if frag not in heads:
                        bad.append(f"{rel(page)}:{no}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_readme_is_a_front_door() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    # The two commands come first; CI runs the second one (.ci/run).
    assert lines[3].startswith("sudo ./install.sh --with-criu && sudo cudahook demo")
    assert lines[4].startswith("sudo scripts/test.sh ")
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_named_files_exist() -> None:
    """A file of the repository the docs name in code (`cudahook/...`,
    `tests/...`, `bench/...`) exists: a moved module leaves no stale name."""
    top = r"(?:cudahook|tests|bench|scripts|config|hooks|deploy|docs)"
    bad = []
    for page in PAGES:
        for no, line in enumerate(page.read_text().splitlines(), 1):
            for span in SPAN.findall(line):
                for name in re.findall(rf"(?<![\w/.-]){top}/[\w/.-]*[\w/]", span):
                    if "*" not in name and not (REPO / name).exists():
                        bad.append(f"{rel(page)}:{no}: {name}")
    assert not bad, "\n".join(bad)
