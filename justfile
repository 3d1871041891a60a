# The front door: `just test`, `just lint`, `just bench`, `just fuzz`, `just mutate`,
# `just invariants`, `just diagrams`, `just demo`.

set positional-arguments
set shell := ["bash", "-uc"]

python := "python"

# Run the test suite (the CI profile of the property tests when CI is set), one worker
# per core, each test module on one worker (`just test -n 0` runs it in this process).
test *args:
    {{python}} -m pytest -n auto --dist loadscope "$@"

# The invariant index: the tests marked with each of I1-I12 (collection only, nothing runs;
# `--markdown` for the README's table). Fails when an invariant has no test.
invariants *args:
    {{python}} -m tests.tools.invariant_index "$@"

# ruff, mypy --strict, and the generated sync PostgreSQL code is current.
lint:
    {{python}} -m ruff check statemachine tests bench examples mutate tools
    {{python}} -m mypy
    {{python}} tools/unasync.py --check

# Benchmarks: ratios against floors measured in the same run (`just bench --json`).
bench *args:
    {{python}} -m bench "$@"

# Long fuzzing: the explorer deeper than CI, then the property and stateful tests with the
# long `fuzz` profile (persistent example database, a progress line every 50 examples; the
# adapters' drawn corner replies, 200 each, and 200 drawn ADK confirmation mixes),
# then the long fleet on PostgreSQL (8 workers killed and stopped at random; skips
# without a server), then every row of the adapters' kill -9 matrices (settled calls,
# verifiers at all four boundaries; CI runs their core rows).
fuzz depth="7" *args:
    {{python}} -m statemachine explore --depth "$1"
    HYPOTHESIS_PROFILE=fuzz {{python}} -m pytest -s tests/kit/test_worlds.py tests/kit/test_corners.py \
        tests/core/test_machine.py tests/core/test_codec.py tests/core/test_envelope.py \
        tests/runner/test_remote.py tests/core/test_decoding.py tests/core/test_refusals.py \
        tests/adapters/test_openai_agents_corners.py tests/adapters/test_pydantic_ai_corners.py \
        tests/adapters/test_anthropic_corners.py tests/adapters/test_anthropic_session_corners.py \
        tests/adapters/test_langgraph_corners.py tests/adapters/test_google_adk_corners.py \
        "${@:2}"
    STATEMACHINE_FLEET=long {{python}} -m pytest -s tests/storage/test_fleet.py
    STATEMACHINE_LONG=1 {{python}} -m pytest tests/adapters/test_anthropic_settled.py \
        tests/adapters/test_openai_agents_settled.py tests/adapters/test_pydantic_ai_settled.py \
        tests/adapters/test_anthropic_verifiers.py tests/adapters/test_openai_agents_verifiers.py \
        tests/adapters/test_pydantic_ai_verifiers.py

# Regenerate diagrams/ from the declaration in statemachine/machine.py.
diagrams:
    {{python}} -m statemachine render

# Play the field-report scenarios with injected failures.
demo *args:
    {{python}} -m statemachine demo "$@"

# Mutation testing (long; not in CI): each mutant of mutate/catalogue.py alone in a temp
# copy of the tree, against its module's tests; killed / survived / equivalent per module
# and the score. Exits non-zero below 90%, or on a stale mutant or one whose module does not
# compile once planted (`--module machine`, `--list`, `--jobs 1`).
mutate *args:
    {{python}} -m mutate "$@"
