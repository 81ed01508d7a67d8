"""One line per event on stderr, as key=value pairs.

Every line about a session carries `session=owner/id`; every state change carries its
`reason`. Values with spaces or quotes are quoted so a line splits back into its pairs with
`shlex.split`.
"""

from __future__ import annotations

import sys
import time


def _format(value: object) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if text == "" or any(c in text for c in " \"'=\\\n\t"):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    return text


def log(event: str, **fields: object) -> None:
    parts = [f"ts={time.time():.3f}", f"event={event}"]
    parts += [f"{key}={_format(value)}" for key, value in fields.items() if value is not None]
    try:
        print(" ".join(parts), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # a closed or broken stderr must not take the holder down
