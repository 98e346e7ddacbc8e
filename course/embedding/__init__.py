"""The embedding lookup in Numba CUDA, and what the labs build on it.

- :mod:`~course.embedding.kernels`: the naive and fast gather kernels, word views, launch shapes.
- :mod:`~course.embedding.lookup`: :func:`embedding`, the one validated launch function, and the
  device-side error flag for out-of-range ids; :mod:`~course.embedding.lean`: the lean launch path
  (no per-call argument typing).
- :mod:`~course.embedding.access`: which addresses each thread of a warp touches (coalescing, lab
  1).
- :mod:`~course.embedding.cases`: checks for any lookup function (lab 1's exercises use them).
- :mod:`~course.embedding.fastcheck`: checks that a fast kernel has the layout lab 1's exercise 3
  asks for.
- :mod:`~course.embedding.swap`: lab 2's CPU-copy embedding and the swap into a model.
- :mod:`~course.embedding.bench`: the labs' GPU experiments (bandwidth, small lookups, swap timing);
  :mod:`~course.embedding.launch_cost`: where an eager call's host time goes, part by part.
- :mod:`~course.embedding.verify`: the report behind ``python -m course verify-embedding``.

``from course import embedding as E`` gives the lookup API below.
"""
from course.embedding.cases import (check_bad_ids, check_lookup, check_rejects, diagnose, fallback, lookup_cases,
                                    named_table, poisoned_empty, reject_cases)
from course.embedding.fastcheck import check_fast_kernel
from course.embedding.kernels import (BOUNDS, ID_DTYPES, IMPLS, WEIGHT_DTYPES, WORD_BYTES, EmbeddingIndexError,
                                      as_words, element_view, fast_kernel, launch_config, naive_kernel,
                                      pick_word_bytes)
from course.embedding.lookup import (check_errors, embedding, error_flag, host_bounds_check, reset_errors,
                                     validate)

__all__ = ["BOUNDS", "EmbeddingIndexError", "ID_DTYPES", "IMPLS", "WEIGHT_DTYPES", "WORD_BYTES", "as_words",
           "check_bad_ids", "check_errors", "check_fast_kernel", "check_lookup", "check_rejects", "diagnose",
           "element_view", "embedding", "error_flag", "fallback", "fast_kernel", "host_bounds_check", "launch_config",
           "lookup_cases", "naive_kernel", "named_table", "pick_word_bytes", "poisoned_empty", "reject_cases",
           "reset_errors", "validate"]
