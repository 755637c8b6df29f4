"""Our own C++ CPU kernels: their sources (csrc/), how they are built and loaded, and what
loaded on this machine."""
