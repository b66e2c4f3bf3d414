"""tools.verify_spread's files: what it keeps is read line by line, and what it is asked to read or write is
judged first, in one line (a directory, a stray file or an unwritable --write ended in tracebacks)."""
from __future__ import annotations

import json

from tools.verify_spread import KEEP, load, main


def test_a_line_that_is_not_a_kept_measurement_is_skipped_and_told(tmp_path):
    kept = load(KEEP)
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps(kept[0]) + '\n{"case": "x"}\nnot json\n[1]\n\n')
    told = []
    assert load(path, warn=told.append) == [kept[0]]
    assert [t.split(": ", 1)[0] for t in told] == [f"{path}:{n}" for n in (2, 3, 4)]
    assert "(no shape, tokens" in told[0] and "(not JSON)" in told[1] and "(not an object)" in told[2]


def test_what_it_reads_and_writes_is_judged_before_the_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for argv, says in ((["summary", "--keep", str(tmp_path)], f"--keep {tmp_path}: not a file"),
                       (["summary", "--keep", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
                       (["summary", "--keep", str(KEEP), "--write", str(blocker / "t.md")],
                        f"--write {blocker / 't.md'}: {blocker} is not a directory"),
                       (["run", "--keep", str(blocker / "k.jsonl"), "--cases", "reference"],
                        f"--keep {blocker / 'k.jsonl'}: {blocker} is not a directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("python -m tools.verify_spread: error: ") and says in err[0], err
