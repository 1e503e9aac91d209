"""Test support shipped with jacobeam, as Beam ships ``apache_beam.testing``: fault injection
(``faults``) and a closed-form engine in numpy that stands in for TensorFlow's (``fake_engine``)."""
