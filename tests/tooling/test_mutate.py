"""make mutate's parts that need no vLLM: what counts as a code change."""

from __future__ import annotations

from mutate import code_of

BEFORE = '''
def f(x: int) -> int:
    """Twice x."""
    # a comment
    return 2 * x
'''


def test_docstrings_comments_and_annotations_are_not_code():
    assert code_of(BEFORE) == code_of(
        'def f(x: str) -> bool:\n    """Other words."""\n    return 2 * x\n'
    )


def test_a_changed_expression_is_code():
    assert code_of(BEFORE) != code_of("def f(x: int) -> int:\n    return 3 * x\n")
    assert code_of(BEFORE) != code_of(
        'def f(x: int) -> int:\n    """Twice x."""\n    return 2 * x\n    pass\n'
    )
