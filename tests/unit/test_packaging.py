"""Every source folder is a package that setup.py ships (find_packages skips folders without
__init__.py, which an editable install would hide)."""

from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_folder_is_shipped():
    found = set(find_packages(where=str(ROOT), include=["cwgrpo_megatron", "cwgrpo_megatron.*"]))
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "cwgrpo_megatron").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert folders <= found, f"not shipped: {sorted(folders - found)}"
