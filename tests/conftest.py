import pytest

from .etcd import etcd_server  # noqa: F401  (fixture)
from .netns import netns_nodes  # noqa: F401  (fixture)
from .procs import launch, log_tails, startup_seconds  # noqa: F401  (fixtures)
from .references import reference  # noqa: F401  (fixture)
from .s3 import s3_bucket, s3_server  # noqa: F401  (fixtures)
from .slurm import slurm_cluster  # noqa: F401  (fixture)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that launched jobs reports their last log lines (tests/procs.py)."""
    report = yield
    jobs = getattr(item, "launched_jobs", None)
    if report.when == "call" and report.failed and jobs:
        report.sections.append(("job logs", log_tails(jobs)))
    return report
