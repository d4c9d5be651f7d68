# The compiled record routing's interface (exchange/writer/routing.pyx); Python code sees
# it through routing.pyi.

cdef Py_ssize_t c_partition(object key, object partition_func, Py_ssize_t n) except -1
