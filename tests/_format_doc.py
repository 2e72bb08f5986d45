"""docs/format.md's plain-numpy reader of a native db, as printed there: the tests run that
code block itself (our own text), so the page and the format cannot drift apart."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


def documented_read_native() -> Callable[[str], dict[str, Any]]:
    """The page's ``read_native(path)``, compiled from its code block."""
    text = DOC.read_text()
    section = text[text.index("## Reading a native db without epochal"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    ns: dict[str, Any] = {}
    exec(compile(code, str(DOC), "exec"), ns)
    return ns["read_native"]  # type: ignore[no-any-return]
