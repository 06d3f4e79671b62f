"""The HTML report of a run or of benchmark results: one self-contained page (page.py), its parts for
runs (html.py) and benchmarks (bench.py), and the plots (plots.py). Reads files a run or a bench
wrote; imports `run` (metrics) and the pipeline timeline, never an engine."""
