"""Run profiles: the same suites at CPU-CI scale (quick) or GPU scale (full).

A profile only scales sizes (request counts, lengths, sweeps); the shape of
every workload, and so what each suite asserts, is the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec


@dataclass(frozen=True)
class Profile:
    name: str
    #: Requests in a standard comparison run.
    num_requests: int
    #: Concurrency of the standard closed-loop run.
    concurrency: int
    #: Median prompt / output length of the chat-like workload.
    prompt_median: int
    output_median: int
    #: Longest prompt/output the lengths are clipped to (must fit max_model_len).
    max_len: int
    #: Concurrency sweep for the latency-throughput curve.
    sweep: tuple[int, ...]
    request_timeout_s: float
    #: The engine's context window (prompt + output).
    max_model_len: int


PROFILES: dict[str, Profile] = {
    # Sized for two CPU cores and a tiny model: every suite finishes in CI's budget.
    "quick": Profile("quick", num_requests=48, concurrency=8, prompt_median=64, output_median=32,
                     max_len=256, sweep=(1, 2, 4, 8, 16, 32), request_timeout_s=120.0, max_model_len=2048),
    # Sized for one datacenter GPU and a real model.
    "full": Profile("full", num_requests=1000, concurrency=64, prompt_median=512, output_median=256,
                    max_len=4096, sweep=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), request_timeout_s=600.0,
                    max_model_len=8192),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of: {', '.join(PROFILES)}")
    return PROFILES[name]


def chat_workload(profile: Profile, *, seed: int = 0, arrival: Arrival | None = None) -> Workload:
    """Chat-like traffic: lognormal prompt and output lengths (long tail), mixed in every batch."""
    return WorkloadSpec(
        name="chat",
        num_requests=profile.num_requests,
        prompt=Lengths.lognormal(profile.prompt_median, 0.8, low=4, high=profile.max_len),
        output=Lengths.lognormal(profile.output_median, 0.8, low=2, high=profile.max_len),
        arrival=arrival or Arrival("closed", concurrency=profile.concurrency),
        seed=seed,
    ).build()
