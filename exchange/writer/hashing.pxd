# The compiled deterministic hash's interface: exchange/writer/routing.pyx cimports it and
# hashes at C speed. Python code sees deterministic_hash through hashing.pyi.

cdef inline unsigned int fib_hash(unsigned long long k) noexcept nogil:
    """deterministic_hash of an int key in [-2**63, 2**63), given as ``key mod 2**64``:
    the top 32 bits of ``k * FIBONACCI_64 mod 2**64``."""
    return <unsigned int>((k * 0x9E3779B97F4A7C15ULL) >> 32)


cdef unsigned int c_hash(object key) except? 0xFFFFFFFFU
