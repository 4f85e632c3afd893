"""Test-wide settings: `make test` (and so CI) runs hypothesis under the derandomized "ci" profile, so a
property test tries the same examples on every run and a failure reproduces; plain `pytest` keeps the random
default profile for exploring."""

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
