"""jacobeam: per-sample Jacobians of TensorFlow models in bulk, with Apache Beam, stored as HDF5 shards.

The distribution's one import root. Its packages live in the repository's top-level folders (setuptools
``package-dir``): ``jacobeam.transforms`` (``transforms/``: the Beam transforms, the engine, input
formats, output files) and ``jacobeam.pipeline`` (``pipeline/``: the command line, configuration,
planning, inspect and verify). Importing this package imports neither Beam nor TensorFlow; it makes
TensorFlow's later import skip the optional packages it would import for nothing (``tensorflow_import``).
"""

from jacobeam import tensorflow_import

tensorflow_import.install()  # before anything imports TensorFlow: see the module
