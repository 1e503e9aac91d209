"""``python -m jacobeam``: the ``jacobeam`` command."""

import sys

from jacobeam.pipeline.cli import main

sys.exit(main())
