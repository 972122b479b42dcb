"""pytest-sparse-mla: a pytest plugin and regression suites for DeepSeek-V4-style sparse MLA
attention kernels over packed FP8 paged KV caches.

Importing this package is light: it imports neither torch, triton nor flashinfer. The modules
that compute (``formats``, ``page_split``, ``attention``) import torch themselves.
"""

__version__ = "0.1.0"
