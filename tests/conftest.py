import pytest

from .etcd import etcd_server  # noqa: F401  (fixture)
from .netns import netns_nodes  # noqa: F401  (fixture)
from .procs import launch, log_tails, startup_seconds  # noqa: F401  (fixtures)
from .references import reference  # noqa: F401  (fixture)
from .s3 import s3_bucket, s3_server  # noqa: F401  (fixtures)
from .slurm import slurm_cluster  # noqa: F401  (fixture)

# fixtures that start a server, a cluster or real torchrun jobs: a test using one is in the
# multi-process tier (``slow``), so the fast tier (``-m "not slow"``) needs none of them
_SLOW_FIXTURES = {"etcd_server", "netns_nodes", "s3_server", "s3_bucket", "slurm_cluster",
                  "launch", "reference", "prometheus_server"}


def pytest_collection_modifyitems(config, items):
    """Mark the tests that use a server, a cluster or torchrun ``slow``; the mini-soaks
    (``soak``) run only when ``-m`` names them (``pytest -m soak``): they are deselected, and
    counted as such in the summary, otherwise."""
    soaks = []
    for item in items:
        if _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("soak") is not None:
            soaks.append(item)
    if soaks and "soak" not in (config.option.markexpr or ""):
        config.hook.pytest_deselected(items=soaks)
        items[:] = [item for item in items if item not in soaks]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that launched jobs reports their last log lines, and where the processes
    of the jobs still running were (their stacks, before the teardown kills them: a job held
    up in a collective shows where; tests/procs.py)."""
    report = yield
    jobs = getattr(item, "launched_jobs", None)
    if report.when == "call" and report.failed and jobs:
        report.sections.append(("job logs", log_tails(jobs)))
        running = [job for job in jobs if job.proc.poll() is None]
        if running:
            report.sections.append(("running jobs' stacks",
                                    "\n".join(job.stacks() for job in running)))
    return report
