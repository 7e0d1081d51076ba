"""Files that are never seen half-written: written to a temporary name beside them, renamed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to `path` through a temporary file in the same folder and a rename; on any
    failure the temporary file is removed and `path` keeps its old content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 110) -> Path:
    """Save a matplotlib figure as a PNG through `write_atomic`, then close it."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return write_atomic(path, buffer.getvalue())


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A hidden temporary folder beside `path` to fill; when the block ends without error it
    replaces `path` (any old folder there is removed first), else it is removed and `path`
    keeps what it held."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial"))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
