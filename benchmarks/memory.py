"""Peak resident memory of this process since a reset (Linux /proc).

`ru_maxrss` is inherited across fork + exec from the parent, so a child started by a large
parent would report the parent's peak; VmHWM belongs to the address space, is fresh after exec,
and can be reset to the current RSS by writing 5 to /proc/self/clear_refs.
"""

from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Reset the high-water mark to the current RSS; returns that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_since_reset() -> int:
    """The high-water RSS in bytes since the last `reset_peak`."""
    return _status_kib("VmHWM") * 1024
