"""The throughput suite: folder vs LMDB / HDF5 / WebDataset, cold and warm, to results.json and a table.

`python -m benchmarks run` measures; `python -m benchmarks compare OLD NEW` gates regressions.
"""
