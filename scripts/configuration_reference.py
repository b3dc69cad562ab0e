"""Write docs/reference/configuration.md from the settings' declarations and the parser
(``--check``: exit 1 if the committed file differs instead)."""

from __future__ import annotations

import sys
from pathlib import Path

from tokenline.cli import build_parser
from tokenline.settings.reference import configuration_reference

TARGET = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"


def main(argv: list[str]) -> int:
    text = configuration_reference(build_parser())
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is out of date: run python scripts/configuration_reference.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
