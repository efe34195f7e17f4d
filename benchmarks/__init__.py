"""Speed and memory benchmarks (issue 8); `python benchmarks/run.py --help`."""
