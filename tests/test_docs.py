"""The docs hold what they promise: the site builds in MkDocs' strict mode (a broken link, a missing
page or a page left out of the nav fails), every `tokenline …` command line in a code block of the
README or the site parses with the real argument parser (and every flag a command quoted in prose
names exists), and every relative link in the README leads to a file (and every README anchor to
a heading)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tokenline.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
# `tokenline` where a shell runs it: at the start, after a prompt, an env assignment, a path, `do`, a
# `;`/`&`/`|` or an opening backtick (a command quoted in a comment).
COMMAND = re.compile(r"(?:^|[;&|`]\s*|\$\s+|\bdo\s+)(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\S*/)?tokenline\s+(?=[a-z])(.*)$")
needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed")


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # this checkout's tokenline for the hook that generates the reference pages
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=120)


@needs_mkdocs
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    result = _mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    # the generated reference pages and the included ARCHITECTURE.md are there
    assert "--max-num-seqs" in (tmp_path / "site/reference/configuration/index.html").read_text()
    assert "/v1/chat/completions" in (tmp_path / "site/reference/api/index.html").read_text()
    assert "Packages along the request path" in (tmp_path / "site/architecture/index.html").read_text()


@needs_mkdocs
def test_strict_mode_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The same validation settings as mkdocs.yml's turn a link to a missing page into a failure."""
    config = (REPO / "mkdocs.yml").read_text()
    validation = re.search(r"^validation:\n(?:  .*\n)+", config, re.M)
    assert validation and re.search(r"^strict: true$", config, re.M)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/index.md").write_text("# Home\n\nSee [the guide](guide/missing.md).\n")
    (tmp_path / "mkdocs.yml").write_text(f"site_name: t\nstrict: true\n{validation.group(0)}")
    result = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0 and "missing.md" in result.stderr


def _command_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, the words after `tokenline`) for each command in the page's shell code blocks;
    in a block with `$ ` prompts only the prompted lines are commands (the rest is output)."""
    found: list[tuple[int, str]] = []
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        start = i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].strip().startswith("```")), len(lines))
        i = end + 1
        if fence[3:].strip() not in SHELL_FENCES:
            continue
        block = lines[start:end]
        prompted = any(line.lstrip().startswith("$ ") for line in block)
        k = 0
        while k < len(block):
            number, line = start + k + 1, block[k]
            while line.endswith("\\") and k + 1 < len(block):  # a continued command line
                k += 1
                line = line[:-1] + " " + block[k].strip()
            k += 1
            if prompted and not line.lstrip().startswith("$ "):
                continue
            match = COMMAND.search(line)
            if match:
                found.append((number, match.group(1)))
    return found


def _argv(words: str) -> tuple[list[str], list[str]]:
    """The arguments as the shell would pass them, placeholders given a value: a shell variable
    (`$p`, `$HOME`) is 1, an optional `[MODEL]` is a path, `<what>` is a word, `…` (more flags) is
    dropped. The command ends where the shell's would: a comment, `&`, `;`, `|` or a closing backtick.
    Optional groups (`[--flag VALUE]`, `[--a ... | --b FILE]`) are left out of the arguments; the
    flags they name come back apart, to be checked against the command's options."""
    optional = [flag for group in re.findall(r"\[(--[^\[\]]*)\]", words) for flag in re.findall(r"--[\w-]+", group)]
    words = re.sub(r"\[--[^\[\]]*\]", " ", words)
    words = re.sub(r"\$\{?\w+\}?", "1", words)
    words = re.sub(r"\[([A-Z_]+)\]", lambda m: m.group(1).lower(), words)
    words = re.sub(r"<[^<>\s]+>", "x", words)
    lexer = shlex.shlex(words, posix=True, punctuation_chars=";&|`")
    lexer.whitespace_split = True
    argv = []
    for word in lexer:
        if word and set(word) <= set(";&|`"):
            break
        if word not in ("…", "..."):
            argv.append(word)
    return argv, optional


def _parse_error(command: tuple[list[str], list[str]]) -> str | None:
    argv, optional = command
    parser, stderr = build_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
    except SystemExit as exc:
        return stderr.getvalue().strip() or f"exit {exc.code}"
    unknown = [flag for flag in optional if flag not in parser.command_parser(args)._option_string_actions]
    return f"unknown optional flags {unknown}" if unknown else None


def test_every_documented_command_line_parses() -> None:
    commands = [(page, number, words) for page in PAGES for number, words in _command_lines(page)]
    assert len(commands) >= 20, "the extraction found too few command lines to be working"
    wrong = []
    for page, number, words in commands:
        error = _parse_error(_argv(words))
        if error:
            wrong.append(f"{page.relative_to(REPO)}:{number}: tokenline {words}\n    {error}")
    assert not wrong, "\n".join(wrong)


def test_flags_in_inline_commands_exist() -> None:
    """Prose quotes commands in code spans with placeholders (`tokenline simulate --replicas N`):
    too loose to parse, but every flag such a span names must be an option of its command."""
    wrong = []
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`(?:\S*/)?tokenline ([a-z][^`]*)`", prose):
            parser = build_parser()
            words = span.split()
            for word in words:  # down to the (sub)command the span names
                if parser.commands is None or word not in parser.commands.choices:
                    break
                parser = parser.commands.choices[word]
            flags = [word.split("=")[0] for word in words if word.startswith("--")]
            wrong += [f"{page.relative_to(REPO)}: tokenline {span}: {flag}" for flag in flags
                      if flag not in parser._option_string_actions]
    assert not wrong, "\n".join(wrong)


def test_the_command_line_check_can_fail() -> None:
    assert _parse_error(_argv("serve --no-such-flag 1")) is not None
    assert _parse_error(_argv("serve [--no-such-flag 1]")) is not None
    assert _parse_error(_argv("serve [MODEL] --port $p --max-num-seqs 64 [--api-key ... | --keys F] # a comment")) is None


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    text = re.sub(r"```.*?```", "", readme, flags=re.S)
    anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "no links found: the README should link to the docs"
    wrong = []
    for target in targets:
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        if path and not (REPO / path).exists():
            wrong.append(target)
        elif not path and anchor not in anchors:
            wrong.append(target)
    assert not wrong, wrong
