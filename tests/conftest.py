"""Fixtures every test package shares: the real data sets in ../shared/data (tests skip without them)."""

from pathlib import Path

import pytest

SHARED_DATA = (Path(__file__).resolve().parents[1] / ".." / "shared" / "data").resolve()


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"shared data file {path} is absent (see ../shared/data/README.md)")
    return path


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return shared_file("tinyshakespeare.txt")


@pytest.fixture(scope="session")
def alpaca_path() -> Path:
    return shared_file("alpaca_en_demo.json")


@pytest.fixture(scope="session")
def hh_path() -> Path:
    return shared_file("hh-rlhf-harmless-base-test.jsonl.gz")
