# Types of the compiled record routing (exchange/writer/routing.pyx), for mypy --strict.
from collections.abc import Callable, Iterator
from typing import Any, Final

KEY_CACHE: Final[int]
KEY_CACHE_LEN: Final[int]

def register_int_value_hash(func: Callable[[Any], int]) -> None: ...
def register_str_hash(func: Callable[[Any], int], requires_env: str | None = None) -> None: ...
def partition_of(key: Any, partition_func: Callable[[Any], int] | None, n: int) -> int: ...
def route(
    it: Iterator[Any],
    lists: list[list[Any]],
    partition_func: Callable[[Any], int] | None,
    key_func: Callable[[Any], Any] | None,
    cache: dict[Any, int],
    limit: int,
) -> int: ...
