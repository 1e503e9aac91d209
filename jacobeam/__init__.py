"""jacobeam: per-sample Jacobians of TensorFlow models in bulk, with Apache Beam, stored as HDF5 shards.

The distribution's one import root. Its packages live in the repository's top-level folders (setuptools
``package-dir``): ``jacobeam.transforms`` (``transforms/``: the Beam transforms, the engine, input
formats, output files) and ``jacobeam.pipeline`` (``pipeline/``: the command line, configuration,
planning, inspect and verify). Importing this package imports neither Beam nor TensorFlow, and changes
nothing of the process's imports.
"""
