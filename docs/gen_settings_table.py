"""The README's table of LYCORIS_* variables, generated from ``lycoris_ops/settings.py``.

    python docs/gen_settings_table.py            # print the table
    python docs/gen_settings_table.py --write    # replace the table in README.md
    python docs/gen_settings_table.py --check    # exit 1 when README.md's table differs

The table sits between the ``<!-- settings -->`` and ``<!-- /settings -->`` lines of
README.md; ``settings.SETTINGS`` is its only source (tests/docs/test_docs.py runs the
check, so the two cannot drift apart).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- settings -->", "<!-- /settings -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table() -> str:
    """The markdown table: variable, default, valid values, meaning (one row per setting)."""
    from lycoris_ops import settings

    lines = ["| variable | default | valid values | meaning |", "| --- | --- | --- | --- |"]
    for s in settings.SETTINGS.values():
        lines.append(f"| `{s.name}` | {_cell(s.shown_default)} | {_cell(s.valid_values())} | {_cell(s.meaning)} |")
    return "\n".join(lines)


def split(text: str):
    """(before, the table in the README, after); ValueError without exactly one marker pair."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md must hold one {BEGIN} ... {END} pair")
    head, rest = text.split(BEGIN, 1)
    body, tail = rest.split(END, 1)
    return head + BEGIN + "\n", body.strip("\n"), "\n" + END + tail


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs")
    a = p.parse_args(argv)
    want = table()
    if not (a.write or a.check):
        print(want)
        return 0
    with open(README, encoding="utf-8") as f:
        text = f.read()
    head, have, tail = split(text)
    if a.check:
        if have != want:
            print("README.md's settings table differs from lycoris_ops/settings.py; "
                  "run: python docs/gen_settings_table.py --write", file=sys.stderr)
            return 1
        return 0
    with open(README, "w", encoding="utf-8") as f:
        f.write(head + want + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
