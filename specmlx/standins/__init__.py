"""Stand-ins that specmlx builds for itself, from the one real model it can get offline
(SmolLM2-135M): the CPU demo pair (cpu_demo) and the distilled CPU pair's draft
(cpu_distilled). Developer tooling shipped so that `specmlx models build` works on a fresh
machine, not library code: nothing in specmlx imports this package but the `models build`
command (tests/test_layout.py holds that line)."""
