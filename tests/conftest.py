from .procs import launch  # noqa: F401  (fixture)
