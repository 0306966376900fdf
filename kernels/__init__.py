"""Hot ops only, importing nothing else of RadixServe: fused CPU C++ kernels (csrc/, built at
first use) with plain-torch fallbacks that compute the same thing (`cpu_ops`)."""
