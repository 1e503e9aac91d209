"""The output folder: its storage (local or remote), the shard writer, and the files' names and records.
Never imports Beam."""
