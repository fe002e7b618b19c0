"""Every `python launch.py` command in README.md and docs/ runs, as a dry run, against the shipped site files
(issue 46 item 1: the README's own 9B example was refused by the memory plan, and nothing noticed).

Commands are taken from the fenced code blocks and the inline code spans, with `\\` continuations joined and
trailing `# comments` dropped. A documented site placeholder becomes a shipped site (SITES). Commands that are
templates rather than commands (`[overrides]`, `...`, `<...>`, `a|b`) are left out, and the test checks that
there are few of them. A command shown in the docs to be refused must be refused with the message shown (REFUSED).
"""

import re
import shlex
import subprocess
import sys

import pytest

from slime_hydra.config import PROJECT_ROOT

DOCS = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
SITES = {"cluster=mysite": "cluster=slurm_8xh100"}
"""Site names the docs use for the user's own site file, and the shipped site file that stands in for them."""
REFUSED = {"rollout.temprature=0.7":
           "unknown key 'temprature' in RolloutConfig (rollout); did you mean 'rollout.temperature'?"}
"""An override in a documented command that the docs show being refused -> what the refusal must say."""
TEMPLATE = re.compile(r"\.\.\.|\[overrides\]|<[^>]*>|\|")


def documented() -> list[tuple[str, str]]:
    """(where, command) of every `python launch.py` command in the docs, in order, without duplicates."""
    found: dict[str, str] = {}
    for path in DOCS:
        lines, fenced = path.read_text().splitlines(), False
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            pieces = ([line] if fenced else re.findall(r"`([^`]*python launch\.py[^`]*)`", line))
            for piece in pieces:
                if "python launch.py" not in piece:
                    continue
                command = piece[piece.index("python launch.py"):]
                follow = number
                while fenced and command.rstrip().endswith("\\") and follow < len(lines):
                    command = command.rstrip()[:-1] + " " + lines[follow].strip()
                    follow += 1
                command = re.sub(r"\s+#.*$", "", command).strip()
                found.setdefault(command, f"{path.name}:{number}")
    return [(where, command) for command, where in found.items()]


COMMANDS = documented()
RUNNABLE = [(where, command) for where, command in COMMANDS if not TEMPLATE.search(command)]


def test_the_docs_hold_commands_and_few_are_templates():
    assert len(COMMANDS) >= 25, COMMANDS
    templates = [command for _, command in COMMANDS if TEMPLATE.search(command)]
    assert len(templates) <= len(COMMANDS) // 3, templates


@pytest.mark.parametrize("where, command", RUNNABLE, ids=[where for where, _ in RUNNABLE])
def test_a_documented_command_runs_as_shown(where, command, tmp_path):
    args = [SITES.get(arg, arg) for arg in shlex.split(command)[2:]]
    if not {"--help", "--cfg"} & set(args):
        args = [arg for arg in args if not arg.startswith(("output_dir=", "dry_run="))]
        args += ["dry_run=true", f"output_dir={tmp_path}"]
    out = subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), *args], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    refused = [why for override, why in REFUSED.items() if override in args]
    if refused:
        assert out.returncode == 2 and refused[0] in out.stderr, f"{where}: {command}\n{out.stderr[-2000:]}"
        return
    assert out.returncode == 0, f"{where}: {command}\n{out.stdout[-1500:]}\n{out.stderr[-2500:]}"
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    if "dry_run=true" in args:
        assert "config valid, nothing started" in out.stdout, out.stdout[-1500:]
