"""Test-wide settings and fixtures.

`make test` (and so CI) runs hypothesis under the derandomized "ci" profile, so a property test tries the same
examples on every run and a failure reproduces; plain `pytest` keeps the random default profile for exploring.

`engine` and `app` are the API tests' default: the tiny preset on the CPU with torch attention, in process,
one engine per test module. A module that needs another configuration defines its own `engine` (or `app`),
which pytest takes over these."""

import pytest
from hypothesis import settings

from tests.engine_helpers import started_engine

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)


@pytest.fixture(scope="module")
def engine():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=256) as eng:
        yield eng


@pytest.fixture(scope="module")
def app(engine):
    from server.api.app import create_app

    return create_app(engine)
