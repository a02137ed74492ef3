"""Fixtures every test package shares: the real data sets in ../shared/data (tests skip without them).
Multi-rank tests fork their ranks from a server that has already imported the project's modules."""

import sys
from pathlib import Path

import pytest

from trainer.spawn import preload_in_ranks

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "scripts"}  # the project's own

SHARED_DATA = (ROOT / ".." / "shared" / "data").resolve()


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"shared data file {path} is absent (see ../shared/data/README.md)")
    return path


def pytest_collection_finish(session):
    """Every project module the collected tests import, imported once in the ranks' fork server."""
    preload_in_ranks(["pytest", *sorted(m for m in sys.modules if m.partition(".")[0] in PACKAGES)])


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return shared_file("tinyshakespeare.txt")


@pytest.fixture(scope="session")
def alpaca_path() -> Path:
    return shared_file("alpaca_en_demo.json")


@pytest.fixture(scope="session")
def hh_path() -> Path:
    return shared_file("hh-rlhf-harmless-base-test.jsonl.gz")
