"""pytest-sparse-mla: a pytest plugin and regression suites for DeepSeek-V4-style sparse MLA
attention kernels over packed FP8 paged KV caches.

Importing this package is light: it imports neither torch, triton nor flashinfer. The modules
that compute (``page_split``, ``attention``) import torch themselves; ``formats`` imports it inside
the functions that compute, so that its tables (record and call formats) are read without it.

Public names here: :class:`Envelope` and :class:`Widths` (what a kernel's ``sparse_mla_forward``
serves; ``pytest_sparse_mla.envelope``) and :class:`Unsupported` (raised by a kernel for a call it
refuses at run time).
"""

from pytest_sparse_mla.envelope import Envelope, Unsupported, Widths

__all__ = ["Envelope", "Unsupported", "Widths", "__version__"]

__version__ = "0.1.0"
