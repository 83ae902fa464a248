"""Entry points only: absl flags -> ``Config`` -> library calls (``python -m launch.main``, ``launch.plan``,
``launch.bench``, ...), and ``launch.api`` for the same from Python. Nothing in the library imports this."""
