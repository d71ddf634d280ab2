"""Reproducible benchmarks behind `kvctl bench ...`.

Each benchmark returns a JSON-safe dict in which every figure sits beside a reference measured in
the same run on the same machine (memcpy, plain file I/O), so results from different machines are
read as ratios rather than absolute numbers. Modules here import nothing heavy at module level:
the CLI imports them lazily and rendering libraries are imported only by the render functions.
"""
