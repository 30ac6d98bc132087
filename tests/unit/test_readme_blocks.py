"""tests/_readme.py's fenced_block takes the block of the named section, and no other."""

from __future__ import annotations

import pytest

from _readme import fenced_block

TEXT = """# Title

## Example

Prose.

```bash
echo not python
```

```python
# a comment, not a heading
x = 1
```

### Sub-section

## Next

```python
y = 2
```

## Empty

## Open

```python
z = 3
"""


def test_the_first_block_with_the_fence_in_the_section() -> None:
    assert fenced_block(TEXT, "## Example") == "# a comment, not a heading\nx = 1\n"
    assert fenced_block(TEXT, "## Example", "```bash") == "echo not python\n"
    assert fenced_block(TEXT, "## Next") == "y = 2\n"


def test_a_missing_heading_an_empty_section_or_an_open_block_is_an_error() -> None:
    with pytest.raises(ValueError, match="no heading line '## Missing'"):
        fenced_block(TEXT, "## Missing")
    with pytest.raises(ValueError, match="section '## Empty' has no ```python block"):
        fenced_block(TEXT, "## Empty")  # not the block of the section after it
    with pytest.raises(ValueError, match="under '## Open' is never closed"):
        fenced_block(TEXT, "## Open")
    with pytest.raises(ValueError, match="section '### Sub-section' has no"):
        fenced_block(TEXT, "### Sub-section")  # ends at "## Next", a higher level
