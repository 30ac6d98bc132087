"""The README's "Training loops" code is examples/training_loops.py verbatim, and it is right."""

from __future__ import annotations

from pathlib import Path

import pytest
from _readme_fns import readme_grpo_step, readme_train_step

from _ranks import Ranks
from _readme import README, fenced_block

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]


def test_readme_section_is_the_example_verbatim() -> None:
    example = (ROOT / "examples" / "training_loops.py").read_text()
    begin, end = "# --- README: training loops (begin)\n", "# --- README: training loops (end)\n"
    code = example[example.index(begin) + len(begin) : example.index(end)].strip("\n")
    assert fenced_block(README.read_text(), "## Training loops").strip("\n") == code
    assert "def train_step" in code and "def grpo_step" in code


@pytest.mark.parametrize("fsdp_over", ["dp", "dp_cp"])
@pytest.mark.parametrize(("world", "cp"), [(4, 2), (3, 3)])  # dp=2 x cp=2; a cp-only world
def test_readme_train_step_three_steps_match_one_process(
    ranks: Ranks, fsdp_over: str, world: int, cp: int
) -> None:
    """Each README recipe for 3 optimizer steps (it failed at step 2 with a false "sync_grads
    was not called": mesh["cp"] inline, FSDP2 over dp x cp)."""
    ranks(world, readme_train_step, fsdp_over, cp)


@pytest.mark.parametrize("world", [2, 3])
def test_readme_grpo_step_three_steps_match_cp1(ranks: Ranks, world: int) -> None:
    ranks(world, readme_grpo_step)
