"""A mark for tests that judge waits for a CPU: under a CPU quota (a CI runner's cgroup, ``tools/slow-machine``)
the quota's throttling is such a wait, and what they assert (whose work held the CPU) does not hold there."""

from __future__ import annotations

import pytest

from batchbench.core.cpu_quota import cpu_quota

_QUOTA = cpu_quota()

#: Skip where this test process runs under a CPU quota, saying which.
NOT_UNDER_A_CPU_QUOTA = pytest.mark.skipif(
    _QUOTA is not None,
    reason=f"{_QUOTA.text() if _QUOTA else ''} throttles this process: its waits for a CPU are the quota's, not "
           "the work these tests hold the CPU with")
