"""The format of every `PRIVATE_NAMES` in `recompute`: `(attribute, owners)` pairs.

An attribute (a dotted path for an attribute of an attribute) that each owner must
have -- a module or a class by its import path (an instance of the class where the
interface test builds one), or a description of an object the test makes. It is
`accum._inner`'s format; `owned_by` writes the pairs of one owner group at once.
"""


def owned_by(owners, *attributes):
    """`PRIVATE_NAMES` entries: each of `attributes`, on each of `owners` (a tuple)."""
    return tuple((attribute, owners) for attribute in attributes)
