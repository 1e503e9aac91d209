"""Test support shipped with jacobeam, as Beam ships ``apache_beam.testing``: fault injection."""
