"""Input formats: describing files from their headers, reading samples in slices from .npy/.npz/.h5
arrays, TFRecord files and images, and checking each sample as a worker reads it (``checks``). Never
imports Beam."""
