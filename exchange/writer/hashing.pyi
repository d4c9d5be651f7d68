# Types of the compiled deterministic hash (exchange/writer/hashing.pyx), for mypy --strict.
from typing import Any, Final

FIBONACCI_64: Final[int]

def deterministic_hash(key: Any) -> int: ...
def partition_for_key(key: Any, num_partitions: int) -> int: ...
