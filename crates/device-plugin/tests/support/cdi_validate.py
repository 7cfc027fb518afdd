"""Validates CDI spec files against the CDI project's JSON schema (tests/fixtures/cdi/).

Usage: cdi_validate.py SCHEMA_DIR FILE...
Prints "OK FILE" or "INVALID FILE: reason" per file; exits 1 if any is invalid, 2 on a usage
or schema error. schema.json refers to defs.json by a relative reference ("defs.json#/..."),
so defs.json is registered under that name. Needs `jsonschema` (>= 4.18, for `referencing`).
"""
import json
import sys

import jsonschema
from referencing import Registry
from referencing.jsonschema import DRAFT7


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    schema_dir, files = argv[1], argv[2:]
    with open(f"{schema_dir}/schema.json") as f:
        schema = json.load(f)
    with open(f"{schema_dir}/defs.json") as f:
        defs = json.load(f)
    registry = Registry().with_resource("defs.json", DRAFT7.create_resource(defs))
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema, registry=registry)
    bad = 0
    for path in files:
        with open(path) as f:
            text = f.read()
        try:
            doc = json.loads(text)
        except ValueError as e:
            bad += 1
            print(f"INVALID {path}: not JSON: {e}")
            continue
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        if errors:
            bad += 1
            e = errors[0]
            where = "/".join(str(p) for p in e.path) or "(top)"
            print(f"INVALID {path}: at {where}: {e.message}")
        else:
            print(f"OK {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
