"""chunked_mla: the example downstream kernel library of pytest-sparse-mla (see ``kernel``)."""

from chunked_mla.kernel import ChunkedResult, ChunkedSparseMla

__all__ = ["ChunkedResult", "ChunkedSparseMla"]
