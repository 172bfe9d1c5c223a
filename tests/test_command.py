"""The command a results document records (batchbench.core.command): typed again it reproduces the run, and no
secret given on it reaches the document."""

from __future__ import annotations

import shlex

from hypothesis import assume, given
from hypothesis import strategies as st

from batchbench.core.command import REDACTED, invocation

secrets = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="@:/=-"), min_size=6,
                  max_size=20)


@given(secrets)
def test_no_secret_reaches_the_recorded_command(secret: str) -> None:
    argv = ["/venv/bin/batchbench", "run", "--api-key", secret, f"--api-key={secret}",
            "--header", f"Authorization: Bearer {secret}", "--engine-url", f"openai=http://user:{secret}@host:8000/v1"]
    expected = ["batchbench", "run", "--api-key", REDACTED, f"--api-key={REDACTED}", "--header",
                f"Authorization: {REDACTED}", "--engine-url", f"openai=http://{REDACTED}@host:8000/v1"]
    # A "secret" the command's own words hold (batchb, in batchbench) cannot be told from them.
    assume(secret not in shlex.join(expected))
    recorded = invocation(argv)
    assert secret not in recorded
    assert shlex.split(recorded) == expected


def test_what_is_no_secret_is_kept_as_typed_and_the_program_named_as_a_user_types_it() -> None:
    argv = ["/repo/batchbench/__main__.py", "bench", "--engine", "vllm", "--header", "X-Team: search",
            "--concurrency", "1,4", "--model", "my model"]
    assert shlex.split(invocation(argv)) == ["batchbench", *argv[1:]]
    assert invocation(["/venv/bin/pytest", "suites", "-q"]) == "pytest suites -q"
