"""The benchmarks: the code of the `nori bench` commands (this package) and the scripts that
drive them for the README and docs/ (`*.sh`, `step_profile.py`, `kernels_gpu.py`). The figures
they recorded are in the repository's top-level `results/`, outside the installed package."""
