"""The README, and the one way the tests read a fenced code block out of one of its sections."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _level(line: str) -> int:
    """Markdown heading level of ``line`` (``"## x"`` -> 2), 0 when it is no heading."""
    hashes = len(line) - len(line.lstrip("#"))
    return hashes if hashes and line[hashes : hashes + 1] == " " else 0


def fenced_block(text: str, heading: str, fence: str = "```python") -> str:
    """The text of the first ``fence`` block in the section under the line ``heading``.

    The section runs from the ``heading`` line to the next heading of the same or a higher
    level outside a code block (a ``# comment`` in a code block is no heading).

    Args:
        text: Markdown text, e.g. ``README.read_text()``.
        heading: The section's heading line as written, e.g. ``"## Example"``.
        fence: The opening fence line of the block, e.g. ``"```python"`` or ``"```bash"``.

    Returns:
        The lines between the opening and the closing fence, each ending in ``"\\n"``.

    Raises:
        ValueError: No line is ``heading``, or its section has no ``fence`` block, or the
            block is never closed.
    """
    lines = text.splitlines(keepends=True)
    stripped = [line.rstrip() for line in lines]
    if heading not in stripped:
        raise ValueError(f"no heading line {heading!r} in the text; fix the heading named")
    level = _level(heading)
    in_code = False
    for i in range(stripped.index(heading) + 1, len(lines)):
        line = stripped[i]
        if line == fence and not in_code:
            for j in range(i + 1, len(lines)):
                if stripped[j] == "```":
                    return "".join(lines[i + 1 : j])
            raise ValueError(f"the {fence} block under {heading!r} is never closed by ```")
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and 0 < _level(line) <= level:
            break
    raise ValueError(f"the section {heading!r} has no {fence} block; add it or fix the fence")
