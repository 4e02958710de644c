"""Whether a module implements an interface declared as a `typing.Protocol` (the
adapters of `recompute.adapters._adapter`, the inner-optimizer APIs of `accum._inner`): each
helper returns the offending member names, for the test's own assertion."""

import inspect


def missing_members(module, members):
    """The names of `members` that `module` does not define."""
    return [name for name in members if not hasattr(module, name)]


def mismatched_signatures(module, protocol, members):
    """The callable members of `protocol` whose parameters (without `self`) `module`'s
    function does not take, by name and in order."""
    mismatched = []
    for name in members:
        spec = getattr(protocol, name, None)
        if not callable(spec):
            continue
        expected = list(inspect.signature(spec).parameters)[1:]  # without `self`
        if list(inspect.signature(getattr(module, name)).parameters) != expected:
            mismatched.append(name)
    return mismatched


def placeholders(module, members, markers):
    """The callable members of `module` whose source holds one of `markers` (e.g.
    "AssertionError"): a member that raises instead of saying through a value that its
    family lacks the feature."""
    found = []
    for name in members:
        member = getattr(module, name)
        if callable(member) and any(m in inspect.getsource(member) for m in markers):
            found.append(name)
    return found
