# The compiled landing of a data-port client's BufferResponses
# (exchange/protocol/data_landing.pyx). Python code sees it through data_landing.pyi.

cdef class DataLanding:
    cdef readonly object address
    cdef readonly dict channels
    cdef object _landing
    cdef public bint accepting
