"""pytest helpers: assert that a candidate matches a golden by teo's rules."""

from . import golden as _golden


def assert_matches_golden(golden, candidate, **opts):
    """Checks candidate against golden (teo.golden.check's arguments) and raises AssertionError
    with the check's report (the CLI's text, first divergence included) unless it passes.
    Returns the Report when it does."""
    report = _golden.check(golden, candidate, **opts)
    if not report.passed:
        raise AssertionError("candidate does not match %s\n%s" % (
            getattr(golden, "path", None) or golden, report))
    return report
