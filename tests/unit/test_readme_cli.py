"""The README's synopsis of the ``cpshard`` command names real options with their real defaults.

Every ``[--flag ...]`` of the synopsis block must be an option of that sub-command's parser, and a
single number shown for it (``[--steps 3]``, ``[--timeout 120]``) must be its default.
"""

from __future__ import annotations

import re

import pytest

from _readme import README, fenced_block
from cpshard.cli.main import _build


def synopsis_flags(readme: str) -> list[tuple[str, str, str | None]]:
    """``(sub-command, flag, shown value)`` for every bracketed option of the synopsis block."""
    block = fenced_block(readme, "## The `cpshard` command", "```bash")
    out: list[tuple[str, str, str | None]] = []
    command = ""
    for line in block.splitlines():
        if m := re.match(r"cpshard (\w+)", line):
            command = m[1]
        elif not line.startswith(" "):  # `python -m cpshard ...`: no options of its own
            continue
        for flag, value in re.findall(r"\[(--[\w-]+)(?: ([^\]]+))?\]", line):
            out.append((command, flag, value or None))
    return out


def test_the_synopsis_shows_every_sub_command() -> None:
    commands = {c for c, _, _ in synopsis_flags(README.read_text())}
    assert commands == set(_build()[1])


def test_synopsis_options_exist_with_their_defaults() -> None:
    subparsers = _build()[1]
    wrong = []
    for command, flag, shown in synopsis_flags(README.read_text()):
        actions = {s: a for a in subparsers[command]._actions for s in a.option_strings}
        if flag not in actions:
            wrong.append(f"cpshard {command} has no option {flag}")
        elif shown is not None and re.fullmatch(r"\d+(\.\d+)?", shown):
            default = actions[flag].default
            if not isinstance(default, int | float) or float(shown) != default:
                wrong.append(f"cpshard {command} {flag}: README shows {shown}, default {default}")
    assert not wrong, "README's `cpshard` synopsis is out of date:\n" + "\n".join(wrong)


def test_synopsis_flags_reads_the_block() -> None:
    text = (
        "## The `cpshard` command\n\n```bash\ncpshard parity [--ranks 4] [--models a|b]\n"
        "               [--steps 3]\npython -m cpshard ...   # [--not-an-option]\n```\n"
    )
    assert synopsis_flags(text) == [
        ("parity", "--ranks", "4"),
        ("parity", "--models", "a|b"),
        ("parity", "--steps", "3"),
    ]


def test_version_is_one_fact(capsys: pytest.CaptureFixture[str]) -> None:
    """``cpshard --version``, ``cpshard.__version__`` and the installed metadata agree."""
    import importlib.metadata

    import cpshard
    from cpshard.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"cpshard {cpshard.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", cpshard.__version__)
    assert importlib.metadata.version("cpshard") == cpshard.__version__
