# Schemathesis hooks of the API fuzz test (tests/fuzz.rs), loaded through
# SCHEMATHESIS_HOOKS.
#
# An observation names its organization, and the API answers 404 for any
# other than the one of the key that sends it, before it looks at the rest.
# Generated ids are random integers, so without this hook no observation
# got past that check: the entity, the attributes and the message id of an
# observation were never fuzzed. An integer organization_id (a value the
# schema allows) becomes the fuzzed organization's id; anything else is
# left as generated, so bodies meant to be refused still are.
import os

import schemathesis


@schemathesis.hook
def map_body(context, body):
    operation = context.operation
    if (
        operation is not None
        and operation.method.upper() == "POST"
        and operation.path == "/v1/observations"
        and isinstance(body, dict)
        and type(body.get("organization_id")) is int
    ):
        body = dict(body, organization_id=int(os.environ["API_FUZZ_ORGANIZATION_ID"]))
    return body
