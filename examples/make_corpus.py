"""Write the small text corpus that ``examples/token_buckets.py`` reads.

The corpus is pseudo-text from a fixed vocabulary and a seeded generator, so
running this script again writes the same bytes (a test checks it)::

    python examples/make_corpus.py                 # rewrites examples/data/
    python examples/make_corpus.py --out /tmp/c    # somewhere else

Lines vary in length from one word to a long paragraph, so the bucketizer has
something to sort; a few lines are empty or hold only spaces (they tokenize to
nothing), and some words are not ASCII.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

SEED = 20240917
#: File name -> number of lines.
FILES = {
    "part-000.txt": 1200,
    "part-001.txt": 2400,
    "part-002.txt": 1800,
    "part-003.txt": 2600,
}

_STEMS_TEXT = (
    "stream shard rank worker bucket token batch epoch buffer queue pipe state "
    "checkpoint resume seed order round robin central stage filter map count "
    "river stone field window lantern harbour meadow orchard signal letter "
    "morning evening winter summer number paper garden market bridge tower "
    "north south quiet bright slow early late simple exact small large "
    "read write carry hold turn send keep find open close begin finish"
)
_FUNCTION_WORDS_TEXT = "the a an of to in on at by for with from and or but not is was are"
_NON_ASCII_TEXT = (
    "café naïve façade Straße Ångström smørrebrød jalapeño über déjà-vu "
    "Жёлтый поезд 日本語 東京 données ελληνικά Łódź 🙂 ✓"
)
_STEMS = _STEMS_TEXT.split()
_FUNCTION_WORDS = _FUNCTION_WORDS_TEXT.split()
_NON_ASCII = _NON_ASCII_TEXT.split()
_SUFFIXES = ("", "", "", "s", "ed", "ing", "er", "ly")
_PUNCTUATION = (".", ".", ".", "!", "?", ";")


def _word(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.30:
        return rng.choice(_FUNCTION_WORDS)
    if roll < 0.33:
        return rng.choice(_NON_ASCII)
    if roll < 0.35:
        return str(rng.randrange(1, 2000))
    return rng.choice(_STEMS) + rng.choice(_SUFFIXES)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(3, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(_PUNCTUATION)


def _line(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.004:
        return ""
    if roll < 0.006:
        return "   "
    if roll < 0.10:  # headings and fragments
        return " ".join(_word(rng) for _ in range(rng.randint(1, 4)))
    # Most lines are short; a long tail runs to a paragraph.
    sentences = min(12, 1 + int(rng.expovariate(0.7)))
    return " ".join(_sentence(rng) for _ in range(sentences))


def write_corpus(out: Path) -> list[Path]:
    """Write every file of the corpus into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for index, (name, lines) in enumerate(sorted(FILES.items())):
        rng = random.Random(SEED + index)
        text = "\n".join(_line(rng) for _ in range(lines)) + "\n"
        path = out / name
        path.write_bytes(text.encode("utf-8"))
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "data",
        help="folder to write the .txt files into (default: examples/data)",
    )
    args = parser.parse_args()
    for path in write_corpus(args.out):
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
