"""Print every failed or erroring test of the given JUnit XML reports, with its message.

Usage: ``python scripts/junit_recap.py REPORT.xml ...`` (``scripts/test`` passes each part's
report). One block per report with a failure: the part's file name, then per test
``FAILED <module or class>::<test>`` (or ``ERROR``) and the first :data:`MESSAGE_CHARS` characters of
its message, each line indented. A report that is missing or unreadable is named and skipped. Prints nothing
when every test passed; always exits 0 (the parts' exit codes decide the run).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: How much of each message is printed: enough for an assertion's values, short enough for a CI log's tail.
MESSAGE_CHARS = 3000


def recap(paths: list[str]) -> list[str]:
    """The recap's lines for the reports at ``paths`` (empty when nothing failed)."""
    lines: list[str] = []
    for name in paths:
        path = Path(name)
        try:
            root = ET.parse(path).getroot()  # reports pytest wrote in this run, not outside input
        except (OSError, ET.ParseError) as exc:
            if path.name != "*.xml":  # the shell's unexpanded glob: no part ran
                lines.append(f"== {path.name}: unreadable ({exc})")
            continue
        found: list[str] = []
        for case in root.iter("testcase"):
            for outcome in ("failure", "error"):
                element = case.find(outcome)
                if element is None:
                    continue
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (element.get("message") or element.text or "").strip()
                found.append(f"{'FAILED' if outcome == 'failure' else 'ERROR'} {test}")
                found.extend(f"    {line}".rstrip() for line in message[:MESSAGE_CHARS].splitlines())
        if found:
            lines.append(f"== failures of {path.stem}:")
            lines.extend(found)
    return lines


if __name__ == "__main__":
    print("\n".join(recap(sys.argv[1:])))
