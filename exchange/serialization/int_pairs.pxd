# The packed (int, int) frame's interface (exchange/serialization/int_pairs.pyx):
# framing.pyx cimports the decoder; Python code sees the encoder through int_pairs.pyi.

cdef enum:
    _PAIRS_TAG = 0xB1  # the first byte of a packed payload (no pickle opcode)
    _HEADER = 6  # tag, layout, u32 count

cdef list decode_int_pairs(const unsigned char* p, Py_ssize_t n)
