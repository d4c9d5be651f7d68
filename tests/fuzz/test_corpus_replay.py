"""Replays the fuzzers' corpus in the regular suite (no atheris needed).

Every file of ``tests/fuzz/corpus/<target>/`` (inputs the coverage-guided fuzzer found
interesting, see ``fuzz_targets.py``) goes through its target once more: it must parse or
raise one of the target's documented errors (``DOCUMENTED``), and keep the target's
invariants (same result whatever the chunking, poisoned decoders stay poisoned, decoded
messages re-encode to themselves, framed decoders agree with the reference parser).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.kit.modules import load_module

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"


fz: Any = load_module("exchange_tests_fuzz_targets", HERE / "fuzz_targets.py")
TARGETS = sorted(fz.TARGETS)


def _replay(target: str, inputs: list[tuple[str, bytes]]) -> list[str]:
    failures = []
    for name, data in inputs:
        try:
            fz.check(target, data)
        except Exception as e:
            failures.append(f"{name} ({data[:64].hex()}...): {type(e).__name__}: {e}")
    return failures


@pytest.mark.parametrize("target", TARGETS)
def test_every_corpus_file_parses_or_raises_a_documented_error(target: str) -> None:
    files = sorted(p for p in (CORPUS / target).iterdir() if p.is_file())
    assert files, f"no corpus for {target}: run fuzz_targets.py {target}, then --save-to"
    failures = _replay(target, [(p.name, p.read_bytes()) for p in files])
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("target", TARGETS)
def test_seeds_parse_or_raise_a_documented_error(target: str) -> None:
    seeds = fz.seeds(target)
    assert seeds
    assert not _replay(target, [(f"seed {i}", s) for i, s in enumerate(seeds)])


def test_a_decoder_raising_an_undocumented_error_is_a_finding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The harness can fail: an exception outside the documented ones reaches the caller."""

    class Broken(fz.FrameDecoder):  # type: ignore[misc]
        def feed(self, data: Any) -> Any:
            raise KeyError("not a documented error")

    monkeypatch.setattr(fz, "FrameDecoder", Broken)
    with pytest.raises(KeyError):
        fz.check("frame", fz.seeds("frame")[0])


def test_a_decoder_that_depends_on_chunking_breaks_an_invariant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Forgetful(fz.FrameDecoder):  # type: ignore[misc]
        def feed(self, data: Any) -> Any:
            return super().feed(data) if len(data) > 1 else []  # drops 1-byte chunks

    monkeypatch.setattr(fz, "FrameDecoder", Forgetful)
    with pytest.raises(fz.InvariantError):
        fz.check("frame", fz.seeds("frame")[0])


def test_framed_decoders_are_checked_against_the_reference_parser() -> None:
    frames, rest = fz._reference_frames(b"\x00\x00\x00\x02ab\x00\x00\x00\x01", 512)
    assert (frames, rest) == ([b"ab"], "cut")
    assert fz._reference_frames(b"\x00\x00\x02\x01", 512) == ([], "error")
    fz.check("framed", b"\x00\x00\x00\x02ab\x00\x00\x00\x01c")
    fz.check("framed", b"\x00\x00\x00\x02\xff\xfe")  # not UTF-8: the text codec must fail


def test_every_local_message_class_names_its_message_id() -> None:
    from exchange.protocol import codec, local_messages  # noqa: F401 - registers the ids

    registered = dict(codec._EXTENSIONS)
    assert registered, "no local-endpoint message registered"
    wrong = {
        msg_id: cls.__name__
        for msg_id, cls in registered.items()
        if getattr(cls, "MESSAGE_ID", None) != msg_id
    }
    assert not wrong, f"message classes without their MESSAGE_ID: {wrong}"
