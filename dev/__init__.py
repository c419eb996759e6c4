"""Developer tools for the CUDA kernels, off the reading path (dev/README.md)."""
