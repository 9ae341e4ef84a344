"""Writes tests/durations.json, the seconds each test file took, from a JUnit XML report:

    pytest --junitxml=report.xml ... && python tests/durations.py report.xml

tests/conftest.py hands out the longest files first from it; a stale entry only makes the
two workers end less close together."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def main(report: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        seconds[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time", 0))
    ranked = sorted(seconds.items(), key=lambda item: -item[1])
    table = {path: round(value) for path, value in ranked if value >= 1}
    Path(__file__).with_name("durations.json").write_text(json.dumps(table, indent=0) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
