"""One module per benchmark scenario; `bench/run.py` runs them all, `bench/compare.py` side by side."""
