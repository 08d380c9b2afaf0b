#!/usr/bin/python3
"""Reference renders for the C Jinja interpreter (template/): Debian's python3-jinja2 configured as
transformers' apply_chat_template configures it (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, its tojson override, raise_exception, strftime_now).

usage: render_ref.py TEMPLATE_FILE CONTEXTS.json NOW
  TEMPLATE_FILE: the template source, or a tokenizer_config.json (its chat_template is used;
                 a list of named templates: the one named "default")
  CONTEXTS.json: a list of render contexts (objects)
  NOW:           unix time that strftime_now formats (so both sides agree)
Prints a JSON list, one entry per context: {"ok": true, "out": TEXT} or {"ok": false, "error": MSG}.
"""
import json
import sys
from datetime import datetime

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def load_template(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        ct = json.loads(text)["chat_template"]
        if isinstance(ct, list):
            ct = next(t["template"] for t in ct if t["name"] == "default")
        return ct
    return text


def main():
    source = load_template(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        contexts = json.load(f)
    now = datetime.fromtimestamp(int(sys.argv[3]))

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return now.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    results = []
    try:
        tpl = env.from_string(source)
    except Exception as e:  # a template that does not parse: every render fails
        results = [{"ok": False, "error": "parse: %s" % e} for _ in contexts]
        json.dump(results, sys.stdout, ensure_ascii=False)
        return
    for ctx in contexts:
        try:
            results.append({"ok": True, "out": tpl.render(**ctx)})
        except Exception as e:
            results.append({"ok": False, "error": "%s: %s" % (type(e).__name__, e)})
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
