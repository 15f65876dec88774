"""The README's shell commands run as written from a fresh checkout: every Python command uses
the project's venv (the system python lacks its packages), and every module, script and make
target they name exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_lines() -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        joined = block.replace("\\\n", " ")
        lines += [l.strip() for l in joined.splitlines() if l.strip() and not l.strip().startswith("#")]
    return lines


def test_python_commands_use_the_venv():
    bare = [l for l in _bash_lines() if re.search(r"(^|[\s;&|(])python3?\s", l)]
    assert bare == [], f"commands with the system python (use .venv/bin/python): {bare}"
    prose = re.findall(r"`(python3? -m [\w.]+[^`]*)`", README)
    assert prose == [], f"inline commands with the system python: {prose}"


def test_named_modules_scripts_and_targets_exist():
    lines = _bash_lines()
    for mod in re.findall(r"\.venv/bin/python -m ([\w.]+)", " ".join(lines)):
        if mod in ("pytest", "pip"):
            continue
        path = ROOT / mod.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), mod
    for script in re.findall(r"(?:^|\s)((?:scripts|bench)/[\w./-]+\.(?:sh|py))", " ".join(lines)):
        assert (ROOT / script).exists(), script
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for target in re.findall(r"(?:^|\s)make ([\w-]+)", " ".join(lines)):
        assert target in targets, target
