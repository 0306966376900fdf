"""The README's test command reads pytest's closing lines and combines the two halves' exits."""

from tests.run_suite import combined_status, counts


def test_counts_read_the_closing_line_only():
    out = "..F.\n3 passed in the docstring\nFAILED x\n2 failed, 1385 passed, 39 skipped, 2180 warnings in 3580.12s (0:59:40)\n"
    assert counts(out) == {"failed": 2, "passed": 1385, "skipped": 39}
    assert counts("1 passed, 1 error in 0.5s\n") == {"passed": 1, "errors": 1}
    assert counts("no tests ran in 0.01s\n") == {}
    assert counts("collected nothing\n") == {}


def test_a_half_that_selected_nothing_is_no_failure_unless_both_did():
    assert combined_status([0, 0]) == 0
    assert combined_status([5, 0]) == 0
    assert combined_status([0, 1]) == 1
    assert combined_status([2, 5]) == 2
    assert combined_status([5, 5]) == 5
