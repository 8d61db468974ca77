"""The benchmarks, in one place: the code of the `nori bench` commands (this package), the
scripts that drive them for the README (`*.sh`, `step_profile.py`, `kernels_gpu.py`) and the
figures they recorded (`results/`)."""
