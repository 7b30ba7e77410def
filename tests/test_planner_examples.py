"""docs/planning.md shows what tools/plan.py prints for each of its example commands.

The page's examples are written by tools/plan_examples.py from the commands in the page; each
example is checked apart, so a failure names the one whose output changed. The planner is
analytic: each example takes about a second of CPU or less, so these stay in the fast tier.
"""

from __future__ import annotations

import pytest
from support import load_tool

from megazpp.errors import ConfigError

plan_examples = load_tool("plan_examples", register=True)  # its dataclass needs it

PAGE = plan_examples.DOC_PATH.read_text()
EXAMPLES = plan_examples.examples(PAGE)


def test_the_page_has_its_examples():
    assert len(EXAMPLES) == PAGE.count(plan_examples.BEGIN) >= 9
    assert all("--accelerator" in example.args for example in EXAMPLES)


@pytest.mark.parametrize("index", range(len(EXAMPLES)), ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_example_output_is_what_plan_py_prints(index):
    example = EXAMPLES[index]
    assert plan_examples.output_of(example.args) == example.shown, (
        f"docs/planning.md's example {index} (python tools/plan.py {' '.join(example.args)}) is stale: "
        "run python tools/plan_examples.py, then reread the commentary beside it"
    )


def test_a_marker_without_its_block_is_refused():
    broken = PAGE.replace("```\npython tools/plan.py \\\n", "```\npython tools/plan.py\n", 1)
    with pytest.raises(ConfigError, match="is not followed by"):
        plan_examples.examples(broken)
