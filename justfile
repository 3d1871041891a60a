# The front door: `just test`, `just lint`, `just bench`, `just fuzz`.

python := "python"

# Run the test suite (the CI profile of the property tests when CI is set).
test *args:
    {{python}} -m pytest {{args}}

# ruff and mypy --strict.
lint:
    {{python}} -m ruff check statemachine tests bench
    {{python}} -m mypy

# Benchmarks: ratios against floors measured in the same run.
bench *args:
    {{python}} -m bench {{args}}

# The property tests with the long profile.
fuzz *args:
    HYPOTHESIS_PROFILE=fuzz {{python}} -m pytest tests -k "property or stateful or differential" {{args}}
