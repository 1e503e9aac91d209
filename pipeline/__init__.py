"""jacobeam's command line and wiring: config -> plan -> Beam graph -> run."""
