# The compiled commit loop of a producer session (exchange/local/segment_commits.pyx).
# Python code sees it through segment_commits.pyi.

cpdef int commit_segments(object session, object commits) except -1
cpdef tuple segment_indices(object reserved, Py_ssize_t start, Py_ssize_t stop)
