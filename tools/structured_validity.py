#!/usr/bin/env python3
"""tools/structured_validity.py URL [--schemas N] [--per K] [--seed S] [--concurrency C] [--chat] [--dump-schemas]

Structured outputs at scale against a running server (pd-serve or pd-proxy): N JSON Schemas made
from a seeded generator in the JSON Schema Test Suite's shapes (objects with required and optional
properties, nested objects and arrays, enums and consts, anyOf, integer ranges, string lengths,
patterns and formats, $defs/$ref), plus regexes, choices and GBNF grammars; K requests each,
alternating greedy and seeded sampling. Every reply that ends (finish_reason stop) is checked with
python3-jsonschema (formats too), re.fullmatch, the choice list or json.loads; a reply cut at
max_tokens is counted apart. Then the same requests again without a structured output, each with
max_tokens = the tokens its structured reply used and ignore_eos, to compare throughput (output
tokens per second over the batch) with and without the grammar. Prints one JSON line of counts and
rates; exit 1 on any invalid reply.
"""
import argparse
import concurrent.futures as cf
import json
import random
import re
import sys
import time
import urllib.request

import os

import jsonschema

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
from grammar_check import format_checker  # noqa: E402 - RFC 3339 time/date-time, as the tests check them


FC = format_checker()


def gen_schema(rng, depth=0):
    kinds = ["string", "integer", "boolean", "null", "enum", "number", "array", "object", "anyOf", "const",
             "pattern", "format"]
    if depth >= 2:
        kinds = kinds[:6] + ["pattern", "format", "const"]
    k = rng.choice(kinds)
    if k == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 10)}
    if k == "integer":
        s = {"type": "integer"}
        lo = rng.randint(-1000, 1000)
        s["minimum"] = lo
        if rng.random() < 0.7:
            s["maximum"] = lo + rng.randint(0, 5000)
        if rng.random() < 0.3:
            s["exclusiveMinimum"] = lo - 1
            del s["minimum"]
        return s
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "number":
        return {"type": "number"}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "a b", "é"], rng.randint(1, 4))}
    if k == "const":
        return {"const": rng.choice(["fixed", 42, {"k": [1, 2]}, [True, None]])}
    if k == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[A-Z]{2}-\d{3}$", r"^(ab|cd)+x?$", r"^\w{1,8}@\w{1,8}\.com$",
                                                         r"^[^\s\"]{1,5}$", r"^\d{4}-\d{2}$"])}
    if k == "format":
        return {"type": "string", "format": rng.choice(["date", "time", "date-time", "uuid", "ipv4"])}
    if k == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": gen_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    if k == "anyOf":
        return {"anyOf": [gen_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    props = {}
    for i in range(rng.randint(1, 4)):
        props["p%d_%s" % (i, rng.choice(["name", "id", "val", "x"]))] = gen_schema(rng, depth + 1)
    req = [p for p in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def gen_specs(rng, n):
    specs = []
    for i in range(n):
        s = gen_schema(rng) if i % 5 else {"type": "object", "properties": {"node": {"$ref": "#/$defs/n"}},
                                           "required": ["node"], "additionalProperties": False,
                                           "$defs": {"n": {"type": "object", "properties": {
                                               "v": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}},
                                               "required": ["v", "next"], "additionalProperties": False}}}
        specs.append(("schema", s))
    for r in [r"[a-z]{3,8}-\d{2}", r"(yes|no|maybe)( please)?", r"\d{1,3}(\.\d{1,3}){3}", r"[A-Z][a-z]+ [A-Z][a-z]+"]:
        specs.append(("regex", r))
    for c in [["alpha", "beta", "gamma"], ["positive", "negative", "neutral"]]:
        specs.append(("choice", c))
    specs.append(("grammar", 'root ::= "[" num ("," num){0,4} "]"\nnum ::= "-"? [1-9] [0-9]{0,3}'))
    return specs


def post(url, path, body, timeout=600):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def field(kind, spec):
    return {"schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": spec}}},
            "regex": {"structured_outputs": {"regex": spec}},
            "choice": {"structured_outputs": {"choice": spec}},
            "grammar": {"structured_outputs": {"grammar": spec}}}[kind]


def valid(kind, spec, text):
    try:
        if kind == "schema":
            cls = jsonschema.validators.validator_for(spec, default=jsonschema.Draft202012Validator)
            jsonschema.validate(json.loads(text), spec, cls=cls, format_checker=FC)
            return True
        if kind == "regex":
            return re.fullmatch(spec, text, re.ASCII) is not None
        if kind == "choice":
            return text in spec
        json.loads(text)
        return True
    except Exception:  # noqa: BLE001 - any failure is invalid
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--schemas", type=int, default=100)
    ap.add_argument("--per", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dump-schemas", action="store_true",
                    help="print the generated JSON Schemas as one JSON list and exit (URL is ignored)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    specs = gen_specs(rng, args.schemas)
    if args.dump_schemas:
        print(json.dumps([spec for kind, spec in specs if kind == "schema"]))
        return
    jobs = []
    for si, (kind, spec) in enumerate(specs):
        for k in range(args.per):
            body = {"prompt": "Answer in the requested format:", "max_tokens": args.max_tokens}
            if args.model:
                body["model"] = args.model
            body.update({"temperature": 0} if k % 2 == 0 else {"temperature": 1, "seed": 1000 * si + k})
            body.update(field(kind, spec))
            jobs.append((kind, spec, body))
    counts = {"requests": len(jobs), "valid": 0, "invalid": 0, "truncated": 0, "errors": 0}
    used = [0] * len(jobs)

    def run(i):
        kind, spec, body = jobs[i]
        try:
            r = post(args.url, "/v1/completions", body)
        except Exception as e:  # noqa: BLE001
            return i, "errors", str(e)[:200], 0
        c = r["choices"][0]
        n = r["usage"]["completion_tokens"]
        if c["finish_reason"] != "stop":
            return i, "truncated", c["text"][:120], n
        return i, ("valid" if valid(kind, spec, c["text"]) else "invalid"), c["text"][:300], n

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as ex:
        for done, (i, outcome, text, n) in enumerate(ex.map(run, range(len(jobs))), 1):
            counts[outcome] += 1
            used[i] = n
            if done % 100 == 0 or done == len(jobs):
                print("structured_validity: %d/%d replies, %d valid, %d invalid, %d cut, %.0f s" %
                      (done, len(jobs), counts["valid"], counts["invalid"], counts["truncated"],
                       time.perf_counter() - t0), file=sys.stderr, flush=True)
            if outcome in ("invalid", "errors"):
                print(outcome.upper(), jobs[i][0], json.dumps(jobs[i][1])[:200], repr(text), file=sys.stderr)
    t_so = time.perf_counter() - t0
    tok = sum(used)
    # the same requests without a structured output, each as long as its structured reply
    plain = []
    for i, (kind, spec, body) in enumerate(jobs):
        b = {k: v for k, v in body.items() if k not in ("response_format", "structured_outputs")}
        b["max_tokens"] = max(used[i], 1)
        b["ignore_eos"] = True
        plain.append(b)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as ex:
        tok_plain = sum(r["usage"]["completion_tokens"] for r in ex.map(lambda b: post(args.url, "/v1/completions", b), plain))
    t_plain = time.perf_counter() - t0
    counts.update({"specs": len(specs), "output_tokens": tok, "tok_s_structured": round(tok / t_so, 1),
                   "tok_s_plain": round(tok_plain / t_plain, 1),
                   "ratio": round((tok / t_so) / (tok_plain / t_plain), 3)})
    print(json.dumps(counts))
    sys.exit(1 if counts["invalid"] or counts["errors"] else 0)


if __name__ == "__main__":
    main()
