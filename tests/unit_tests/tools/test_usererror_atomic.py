"""The shared pieces every tool uses: the error convention and atomic file writes."""

from __future__ import annotations

import io
import json
import os
import re
import stat
from pathlib import Path

import pytest

from hfsdp.atomic import NonFiniteJSON, json_text, loads_strict, write_json_atomic, write_text_atomic
from hfsdp.usererror import UserError, comma_choices, env_number, output_file, report, run_cli


def test_a_user_error_is_two_lines_and_a_hint(monkeypatch):
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)
    out = io.StringIO()
    assert report("tool", UserError("the cause", "the way out"), out) == 2
    assert out.getvalue() == "tool: error: the cause\n  -> the way out\n  (set HFSDP_DEBUG=1 for a traceback)\n"


def test_hfsdp_debug_adds_the_traceback(monkeypatch, capsys):
    monkeypatch.setenv("HFSDP_DEBUG", "1")

    def fails():
        raise UserError("bad input", "fix it")

    assert run_cli("tool", fails) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "in fails" in err and err.rstrip().endswith("-> fix it")


def test_other_exceptions_are_bugs_and_keep_their_traceback():
    with pytest.raises(ZeroDivisionError):
        run_cli("tool", lambda: 1 / 0)


def test_a_user_error_needs_a_way_out():
    with pytest.raises(AssertionError):
        UserError("cause", "")


def test_atomic_write_keeps_permissions_and_never_leaves_half_a_file(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    write_text_atomic(path, "one")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    path.chmod(0o640)
    write_text_atomic(path, "two")
    assert path.read_text() == "two" and stat.S_IMODE(path.stat().st_mode) == 0o640

    def crash(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, "three")
    assert path.read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_json_is_written_strict_and_a_nan_names_its_place(tmp_path):
    path = tmp_path / "doc.json"
    write_json_atomic(path, {"b": [1.5, None], "a": 1})
    assert path.read_text() == '{\n "a": 1,\n "b": [\n  1.5,\n  null\n ]\n}\n'
    for bad, where in ((float("nan"), "$.runs[1].t is nan"), (float("-inf"), "$.runs[1].t is -inf")):
        with pytest.raises(NonFiniteJSON, match=re.escape(f"not writing {path}: {where}, which JSON cannot hold")):
            write_json_atomic(path, {"runs": [{"t": 1.0}, {"t": bad}]})
    assert json.loads(path.read_text()) == {"a": 1, "b": [1.5, None]}, "a refused document changes nothing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]
    with pytest.raises(NonFiniteJSON, match=r"\$\[0\] is inf"):
        json_text((float("inf"),))


def test_every_json_file_we_write_goes_through_the_strict_writer():
    """``json.dump``/``json.dumps`` write bare NaN tokens by default: only hfsdp/atomic.py may call
    them, everything else writes through it ([Note: strict JSON])."""
    root = Path(__file__).resolve().parents[3]
    calls = re.compile(r"\bjson\.dumps?\(")
    offenders = [f"{path.relative_to(root)}:{n}"
                 for base in ("hfsdp", "scripts") for path in sorted((root / base).rglob("*.py"))
                 if path.name != "atomic.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if calls.search(line)]
    assert offenders == [], f"write JSON with hfsdp.atomic.write_json_atomic / json_text: {offenders}"


@pytest.mark.parametrize(("value", "kwargs", "expected"), [
    (None, {}, 30), ("", {}, 30), ("  ", {}, 30), ("7", {}, 7), (" 7 ", {}, 7), ("0", {"zero": True}, 0),
    ("2.5", {"kind": float}, 2.5),
])
def test_env_number_reads_a_count_or_gives_the_default(value, kwargs, expected):
    environ = {} if value is None else {"KNOB": value}
    assert env_number("KNOB", 30, environ=environ, **kwargs) == expected


@pytest.mark.parametrize(("value", "kwargs", "cause"), [
    ("abc", {}, "KNOB='abc': 'abc' is not a whole number"),
    ("1.5", {}, "KNOB='1.5': '1.5' is not a whole number"),
    ("0", {}, "KNOB='0': must be > 0, got 0"),
    ("-1", {"zero": True}, "KNOB='-1': must be >= 0, got -1"),
    ("nan", {"kind": float}, "KNOB='nan': must be > 0, got nan"),
    ("inf", {"kind": float, "zero": True}, "KNOB='inf': must be >= 0, got inf"),
])
def test_env_number_names_the_variable_of_a_bad_value(value, kwargs, cause):
    with pytest.raises(UserError) as info:
        env_number("KNOB", 30, environ={"KNOB": value}, **kwargs)
    assert info.value.cause == cause and "unset it for the default (30)" in info.value.fix


def test_a_bad_smoke_knob_is_one_sentence():
    """The CPU smoke reads its knobs from a recipe's ENV_VARS; a bad one ends the rank in one
    sentence, before it joins the process group."""
    import subprocess
    import sys

    env = {**os.environ, "HFSDP_SMOKE_GLOO_TIMEOUT_S": "soon"}
    env.pop("HFSDP_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "hfsdp.functional.cpu_smoke"], env=env, text=True,
                          capture_output=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 2, proc.stderr
    assert "cpu_smoke: error: HFSDP_SMOKE_GLOO_TIMEOUT_S='soon': 'soon' is not a number" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_output_paths_name_the_path_given_and_refuse_a_link_to_nothing(tmp_path):
    from hfsdp.usererror import output_file, output_folder

    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    with pytest.raises(UserError) as info:
        output_folder("--log-dir", blocker / "logs")
    assert info.value.cause == f"--log-dir {blocker / 'logs'} lies under {blocker}, which is a file"
    with pytest.raises(UserError) as info:
        output_file("--summary", blocker / "s.txt")
    assert info.value.cause == f"--summary {blocker / 's.txt'} lies under {blocker}, which is a file"
    dangling = tmp_path / "gone"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match="gone is a symbolic link to nothing, not a folder"):
        output_folder("--log-dir", dangling)
    with pytest.raises(UserError, match="which is a symbolic link to nothing"):
        output_folder("--log-dir", dangling / "logs")
    with pytest.raises(UserError, match="which is a symbolic link to nothing"):
        output_file("--summary", dangling / "s.txt")
    assert blocker.read_text() == "mine\n"
    output_folder("--log-dir", tmp_path / "new" / "logs")  # missing folders are made later
    output_file("--summary", tmp_path / "new" / "s.txt")


def test_output_paths_refuse_a_folder_that_is_not_writable(tmp_path, lock_folder):
    from hfsdp.usererror import output_file, output_folder

    locked = lock_folder(tmp_path / "locked")
    with pytest.raises(UserError, match=f"{locked} is not writable"):
        output_folder("--log-dir", locked / "logs")
    with pytest.raises(UserError, match=f"--log-dir {locked}: {locked} is not writable"):
        output_folder("--log-dir", locked)
    with pytest.raises(UserError, match=f"{locked} is not writable"):
        output_file("--summary", locked / "s.txt")


@pytest.mark.parametrize(("text", "says"), [
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('[Infinity]', "Infinity is not a JSON number"),
    ('{"a": 1, "b": {"c": 2, "c": 3}}', "key 'c' is given twice"),
])
def test_files_we_wrote_are_read_back_as_strict_json(text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        loads_strict(text)
    assert loads_strict('{"a": [1, 2.5, "NaN"]}') == {"a": [1, 2.5, "NaN"]}


@pytest.mark.parametrize("kind", ["pipe", "link to nothing"])
def test_an_output_file_that_a_write_in_one_step_would_replace_is_refused(tmp_path, kind):
    target = tmp_path / "out.json"
    if kind == "pipe":
        os.mkfifo(target)
    else:
        target.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match="writing it would put a regular file in its place"):
        output_file("--out", target)
    assert os.path.lexists(target) and not target.is_file()


def test_comma_choices_keep_order_and_refuse_none_unknown_or_repeated():
    allowed = ["a", "b", "c"]
    assert comma_choices("--x", " c, a ,", allowed, "letter") == ["c", "a"]
    assert comma_choices("--x", ["b", "c,a"], allowed, "letter") == ["b", "c", "a"]  # a repeated option's values
    for given, cause, fix in ((",", "--x names no letter", "name one or more of a, b, c"),
                              ("a,z,y", "--x names 'z', 'y', not a letter", "use a, b, c"),
                              ("a,b,a", "--x names a more than once", "name each letter once")):
        with pytest.raises(UserError) as err:
            comma_choices("--x", given, allowed, "letter")
        assert (err.value.cause, err.value.fix) == (cause, fix)
    with pytest.raises(UserError, match="once, please"):
        comma_choices("--x", "b,b", allowed, "letter", once="once, please")
