"""Input formats: reading samples in slices from .npy/.npz/.h5 arrays, TFRecord files and images, and the
input scan. Never imports Beam."""
