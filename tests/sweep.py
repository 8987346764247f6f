"""The quick / slow split of a parametrized sweep (pyproject.toml's ``slow`` marker)."""
import pytest


def sweep(cases, quick=(0,), unpack=True):
    """``cases`` as ``pytest.param``s: those at the indices ``quick`` in the quick suite, the
    rest marked ``slow``. ``unpack``: each case is a tuple of the parametrized arguments
    (False: each case is the one argument's value)."""
    return [pytest.param(*(c if unpack else (c,)), marks=() if i in quick else pytest.mark.slow)
            for i, c in enumerate(cases)]


def firsts(cases, key):
    """The indices of the first case of each ``key(case)`` (a ``sweep``'s ``quick``)."""
    first = {}
    for i, case in enumerate(cases):
        first.setdefault(key(case), i)
    return set(first.values())
