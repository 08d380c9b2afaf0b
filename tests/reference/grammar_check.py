#!/usr/bin/env python3
"""The references for grammar/ (tests/unit/test_grammar.c and the structured-output tests).

  grammar_check.py regex FILE    {"cases": [{"pattern", "ours": [bool]}], "strings": [...]}: our
                                 full matches against Python's re.fullmatch with re.ASCII
                                 (\\d \\w \\s are ASCII classes, as in ECMA-262 and JSON Schema)
  grammar_check.py schema FILE   [{"schema", "outputs": [text]}]: every output parses as JSON and
                                 validates (python3-jsonschema, formats checked)
  grammar_check.py match FILE    [{"kind": "regex"|"choice"|"grammar_json", "spec", "outputs"}]:
                                 outputs re.fullmatch the regex / equal a choice / parse as JSON
Exit 1 on any mismatch, each printed.
"""
import datetime
import json
import re
import sys

# RFC 3339 section 5.6: full-time = partial-time time-offset; date-time = full-date "T" full-time.
# Debian's python3-jsonschema has no rfc3339-validator, so it checks "time" as draft 3's %H:%M:%S
# and "date-time" not at all: these two are checked here, by the RFC's grammar and the calendar.
_TIME = re.compile(r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([zZ]|[+-]([01]\d|2[0-3]):[0-5]\d)", re.ASCII)


def _is_time(v):
    return not isinstance(v, str) or _TIME.fullmatch(v) is not None


def _is_date_time(v):
    if not isinstance(v, str):
        return True
    d, sep, t = v.partition("T") if "T" in v else v.partition("t")
    try:
        datetime.date.fromisoformat(d)
    except ValueError:
        return False
    return sep != "" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", d, re.ASCII) is not None and _is_time(t)


def format_checker():
    """python3-jsonschema's FormatChecker with RFC 3339 "time" and "date-time"."""
    import jsonschema
    fc = jsonschema.FormatChecker()
    fc.checkers["time"] = (_is_time, ())
    fc.checkers["date-time"] = (_is_date_time, ())
    return fc


def check_regex(d):
    bad = n = 0
    for c in d["cases"]:
        for s, ours in zip(d["strings"], c["ours"]):
            n += 1
            if bool(re.fullmatch(c["pattern"], s, re.ASCII)) != ours:
                print("MISMATCH", repr(c["pattern"]), repr(s), "ours", ours)
                bad += 1
    print(n, "regex matches checked,", bad, "mismatches")
    return bad == 0 and n > 0


def check_schema(d):
    import jsonschema
    fc = format_checker()
    bad = n = 0
    for c in d:
        cls = jsonschema.validators.validator_for(c["schema"], default=jsonschema.Draft202012Validator)
        for o in c["outputs"]:
            n += 1
            try:
                jsonschema.validate(json.loads(o), c["schema"], cls=cls, format_checker=fc)
            except Exception as e:  # noqa: BLE001 - any failure is a mismatch
                bad += 1
                print("INVALID", repr(o)[:300], str(e)[:300])
    print(n, "generations validated,", bad, "invalid")
    return bad == 0 and n > 0


def check_match(d):
    bad = n = 0
    for c in d:
        for o in c["outputs"]:
            n += 1
            if c["kind"] == "regex":
                ok = re.fullmatch(c["spec"], o, re.ASCII) is not None
            elif c["kind"] == "choice":
                ok = o in c["spec"]
            else:
                try:
                    json.loads(o)
                    ok = True
                except ValueError:
                    ok = False
            if not ok:
                bad += 1
                print("NO MATCH", c["kind"], repr(c["spec"])[:200], repr(o)[:300])
    print(n, "outputs checked,", bad, "not matching")
    return bad == 0 and n > 0


if __name__ == "__main__":
    data = json.load(open(sys.argv[2]))
    ok = {"regex": check_regex, "schema": check_schema, "match": check_match}[sys.argv[1]](data)
    sys.exit(0 if ok else 1)
