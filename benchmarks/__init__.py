"""Benchmarks of per-sample Jacobians: jacobeam beside the status quo and its peers (``python -m benchmarks``)."""
