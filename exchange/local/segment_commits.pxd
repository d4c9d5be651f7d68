# The compiled commit loop of a producer session (exchange/local/segment_commits.pyx).
# Python code sees it through segment_commits.pyi.

cpdef int commit_segments(object session, object commits) except -1
