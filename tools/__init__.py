"""Development tools of the repository (not shipped): ``python tools/unasync.py``."""
