"""The README's flag table is the parser's own, and the repository speaks of the product, not of its making."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from loom.cli import flag_table

ROOT = Path(__file__).parents[1]


def test_readme_flag_table_is_generated_from_the_parser():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- serve-flags:start[^>]*-->\n(.*?)\n<!-- serve-flags:end -->", readme, re.S)
    assert block is not None
    assert block.group(1) == flag_table("serve"), (
        "README's flag table is stale: replace it with the output of "
        "python -c 'from loom.cli import flag_table; print(flag_table(\"serve\"))'")


def test_no_file_names_a_round_of_work():
    """History lives in git: no session or round of work by ordinal, anywhere in the tracked tree."""
    ordinal = r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\w+teenth|" \
              r"twentieth|thirtieth|fortieth|fiftieth|(twenty|thirty|forty|fifty)-\w+)"
    pattern = re.compile(rf"\b{ordinal}[ -]sessions?\b|\bsessions? \d+\b", re.I)
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".png", ".gguf"} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:20])
