"""The built-in suite that ``pytest --gpuregress`` adds to a project's own tests (cases.py)."""
