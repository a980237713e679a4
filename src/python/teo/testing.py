"""pytest helpers: assert that a candidate matches a golden by teo's rules."""

import inspect

from . import golden as _golden
from ._wire import check_keywords


def assert_matches_golden(golden, candidate, **opts):
    """Checks candidate against golden (teo.golden.check's arguments) and raises AssertionError
    with the check's report (the CLI's text, first divergence included) unless it passes.
    Returns the Report when it does."""
    options = [p.name for p in inspect.signature(_golden.check).parameters.values()
               if p.kind == p.KEYWORD_ONLY]
    check_keywords("teo.testing.assert_matches_golden", opts, options)
    report = _golden.check(golden, candidate, **opts)
    if not report.passed:
        raise AssertionError("candidate does not match %s\n%s" % (
            getattr(golden, "path", None) or golden, report))
    return report
