"""The LaTeX conventions of math answers that both the prompt data (gold answers taken from a
solution) and the rewards (a completion's final answer) read."""

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (balanced braces), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None
